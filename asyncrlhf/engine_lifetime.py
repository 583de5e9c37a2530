"""An engine in processes of its own dies with its generator, however the generator dies.

vLLM starts the engine core as a child of the generator and each worker as a child of the core (`VLLM::
EngineCore`, `VLLM::Worker`). A worker exits when its core does (vLLM watches that), but nothing ends the core
when the generator is SIGKILLed (OOM, chaos, a supervisor's last resort): it is re-parented to init and goes
on holding its memory (host RAM here, GPU memory on a GPU) until a restarted generator cannot start its own
engine. So each worker, told the generator's pid at start (`die_with`, through vLLM's `collective_rpc`),
watches it through a pidfd (no polling, no pid reuse) and, when it exits, SIGKILLs every process between
itself and the generator, itself last. A parent-death signal (`PR_SET_PDEATHSIG`) would need code in the
core's process, which vLLM spawns; the worker is where ours runs.

The workers watch only once the engine has started: a generator killed while its engine starts leaves it
running. `asyncrlhf up` starts each service in a process group of its own and ends what is left of the group
before it restarts the service, and when the run stops (`end_group`).

`descendants` and `alive` read /proc: which processes a generator had, and which of them outlived it (tests,
`asyncrlhf bench chaos`). Linux only, as vLLM is.
"""

from __future__ import annotations

import logging
import os
import select
import signal
import threading
from pathlib import Path

log = logging.getLogger(__name__)

Process = tuple[int, int]  # (pid, start time in clock ticks since boot): a process, never a reused pid


def _stat(pid: int) -> list[str]:
    """The fields of /proc/<pid>/stat after the command name (which may hold spaces): state, ppid, ..."""
    return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()


def ancestors_below(pid: int) -> list[int]:
    """This process and its ancestors up to `pid` (excluded), nearest first; [] when `pid` is not one."""
    chain, current = [], os.getpid()
    while current not in (pid, 0, 1):
        chain.append(current)
        current = int(_stat(current)[1])
    return chain if current == pid else []


def die_with(pid: int) -> list[int]:
    """Watch process `pid` (the generator) from a daemon thread; when it exits, SIGKILL the processes between
    this one and it (`ancestors_below`), this one last. Returns them. Raises RuntimeError when `pid` is not an
    ancestor, OSError where the kernel has no pidfd (Linux < 5.3)."""
    chain = ancestors_below(pid)
    if not chain:
        raise RuntimeError(f"process {pid} is not an ancestor of the engine's worker {os.getpid()}")
    try:
        fd = os.pidfd_open(pid)
    except ProcessLookupError:  # already gone
        _kill(chain)
        return chain
    threading.Thread(target=_kill_when_gone, args=(fd, chain), name="asyncrlhf-die-with", daemon=True).start()
    return chain


def _kill_when_gone(fd: int, chain: list[int]) -> None:
    select.select([fd], [], [])  # a pidfd reads ready once its process exited
    _kill(chain)


def _kill(chain: list[int]) -> None:
    log.warning("the generator exited: ending its engine processes %s", chain)
    for pid in reversed(chain):  # the outermost first (the engine core), this process last
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass


def end_group(pgid: int) -> None:
    """SIGKILL every process left in process group `pgid` (that of a service whose leader exited)."""
    try:
        os.killpg(pgid, signal.SIGKILL)
    except ProcessLookupError:  # nothing left
        pass


def descendants(pid: int) -> list[Process]:
    """Every live descendant of `pid`."""
    children: dict[int, list[Process]] = {}
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                fields = _stat(int(entry.name))
            except (OSError, IndexError):  # exited meanwhile
                continue
            children.setdefault(int(fields[1]), []).append((int(entry.name), int(fields[19])))
    out, todo = [], [pid]
    while todo:
        for child in children.get(todo.pop(), []):
            out.append(child)
            todo.append(child[0])
    return out


def alive(processes: list[Process]) -> list[Process]:
    """Those of `processes` still running (the same pid and start time; a zombie has exited)."""
    out = []
    for pid, started in processes:
        try:
            fields = _stat(pid)
        except OSError:
            continue
        if int(fields[19]) == started and fields[0] != "Z":
            out.append((pid, started))
    return out

"""The engine's processes die with their generator: a process watching the generator (vLLM's worker, here a
plain Python process in the same place: a grandchild of the generator) ends itself and every process between
them (the engine core) when the generator is SIGKILLed; and /proc tells which processes outlived it."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time

import pytest

from asyncrlhf.engine_lifetime import alive, ancestors_below, descendants, die_with

pytestmark = pytest.mark.unit

# generator -> core -> worker, as vLLM spawns them; the worker watches the generator and says so in a file
WORKER = """
import os, sys, time
from asyncrlhf.engine_lifetime import die_with
generator = int(open(f"/proc/{os.getppid()}/stat").read().rsplit(")", 1)[1].split()[1])  # the grandparent
chain = die_with(generator)
open(sys.argv[1], "w").write(" ".join(map(str, chain)))
time.sleep(120)
"""
SPAWN = "import subprocess, sys, time; subprocess.Popen(sys.argv[1:]); time.sleep(120)"


def test_a_killed_generator_takes_the_processes_between_it_and_its_watcher_with_it(tmp_path):
    ready = tmp_path / "watching"
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)}
    generator = subprocess.Popen([sys.executable, "-c", SPAWN, sys.executable, "-c", SPAWN, sys.executable,
                                  "-c", WORKER, str(ready)], env=env)
    try:
        deadline = time.monotonic() + 60
        while not ready.exists():
            assert time.monotonic() < deadline and generator.poll() is None, "the worker never watched"
            time.sleep(0.1)
    finally:
        engine = descendants(generator.pid)
        generator.kill()
        generator.wait()
    core, worker = (int(p) for p in reversed(ready.read_text().split()))
    assert {core, worker} <= {pid for pid, _ in engine}
    deadline = time.monotonic() + 20
    while alive(engine) and time.monotonic() < deadline:
        time.sleep(0.1)
    survivors = alive(engine)
    for pid, _ in survivors:
        os.kill(pid, signal.SIGKILL)
    assert survivors == []


def test_only_an_ancestor_can_be_watched():
    assert ancestors_below(os.getppid()) == [os.getpid()]
    assert ancestors_below(os.getpid() + 10**7) == []
    with pytest.raises(RuntimeError, match="is not an ancestor"):
        die_with(os.getpid() + 10**7)


def test_a_process_that_exited_is_not_alive_and_a_reused_pid_is_not_it():
    child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    (me,) = [p for p in descendants(os.getpid()) if p[0] == child.pid]
    assert alive([me]) == [me] and alive([(me[0], me[1] + 1)]) == []  # another start time: another process
    child.kill()
    child.wait()
    assert alive([me]) == []

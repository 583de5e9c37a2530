"""Services forked from one process that imported the heavy libraries once.

Every service imports torch and transformers when it starts, and the learner DeepSpeed too: measured alone,
the learner's imports take 6.0 s of CPU, the generator's 4.8, the evaluator's 4.5, the reward's 2.3, about
two thirds of a tiny run's CPU under `asyncrlhf up`. On a CPU host `up` (`launch.fork_server`) starts one
fork server, which imports them once, and forks each service from it, a restart included. The child takes
its own environment, log, session and thread count, then runs `python -m services.<kind> ARGS` in itself
(`runpy`); its command line reads as that command's, so `ps` and `pgrep -f` find it as before.

What a fork cannot change afterwards is what the libraries read when they load. OpenMP reads its wait
policy and spin count when torch loads (`asyncrlhf.cores.openmp_env`), so the server is started with the
environment most services share, and a service whose load-time environment differs (`serves`) starts as a
process of its own. The GPU path keeps a process per service: CUDA must not be initialised before a fork,
and a learner of several ranks is started by torchrun. Linux only.

The launcher and the server talk over a socket pair, one JSON object per line: the launcher asks
`{"module", "args", "env", "log", "title"}`, the server answers `{"started": pid}`, and `{"exited": pid,
"code": c}` when that child ends (its exit code, or minus the signal that ended it, as `Popen.returncode`).
"""

from __future__ import annotations

import importlib
import json
import os
import runpy
import select
import signal
import socket
import subprocess
import sys
import time
from collections import Counter
from collections.abc import Callable, Mapping, Sequence
from functools import partial
from pathlib import Path
from typing import Protocol

from asyncrlhf.config import Config
from asyncrlhf.cores import ENV as CORES_ENV
from asyncrlhf.cores import cuda_available
from asyncrlhf.deepspeed_import import import_deepspeed

# what the server imports before it forks, each with its importer (DeepSpeed's keeps mlflow out of it)
PRELOAD: tuple[tuple[str, Callable[[], object]], ...] = (
    ("torch", partial(importlib.import_module, "torch")),
    ("transformers", partial(importlib.import_module, "transformers")),
    ("transformers.modeling_utils", partial(importlib.import_module, "transformers.modeling_utils")),
    ("deepspeed", import_deepspeed),
)
# read by the service itself after the fork (its thread count is applied by the child: `_become`), or by
# nothing where a fork server runs: CUDA_VISIBLE_DEVICES (`launch.gpus`) on a host without CUDA
AFTER_FORK = frozenset({"OMP_NUM_THREADS", CORES_ENV, "PYTHONUNBUFFERED", "TOKENIZERS_PARALLELISM",
                        "CUDA_VISIBLE_DEVICES"})
START_TIMEOUT_S = 120.0


def serves(server_env: Mapping[str, str], env: Mapping[str, str]) -> bool:
    """Whether a server started with `server_env` can fork a service whose environment is `env`: they agree
    on everything but what the service reads after the fork."""
    return loaded(server_env) == loaded(env)


def loaded(env: Mapping[str, str]) -> frozenset[tuple[str, str]]:
    """What of `env` a process reads when it loads the libraries (everything but `AFTER_FORK`)."""
    return frozenset((k, v) for k, v in env.items() if k not in AFTER_FORK)


class Forkable(Protocol):
    """What the fork server needs of a service the launcher plans (`asyncrlhf.processes.Service`)."""

    kind: str
    argv: list[str]
    env: dict[str, str]
    forks: ForkServer | None


def fork_server(cfg: Config, services: Sequence[Forkable]) -> ForkServer | None:
    """The fork server that starts `services`, on a CPU host with `launch.fork_server` (a GPU recipe's CPU
    shape too: the devices its `launch.gpus` names are read by nothing there): started with the environment
    most of them share, and given to every service it can serve (the rest, and a learner under torchrun,
    start as processes of their own)."""
    if not cfg.launch.fork_server or cuda_available() or sys.platform != "linux":
        return None  # (macOS: a fork after its system libraries started threads is not safe)
    forkable = [s for s in services if s.argv[1:3] == ["-m", f"services.{s.kind}"]]
    if not forkable:
        return None
    shared = Counter(loaded(s.env) for s in forkable).most_common(1)[0][0]
    first = next(s for s in forkable if loaded(s.env) == shared)
    server = ForkServer(first.env, cfg.run.path / "logs" / "forkserver.log",
                        f"asyncrlhf fork server of run {cfg.run.name} ({cfg.run.path})")
    for svc in forkable:
        if serves(server.env, svc.env):
            svc.forks = server
    return server


class ServerGone(RuntimeError):
    """The fork server exited (killed, or out of memory): nothing more can be forked from it."""


class ForkServer:
    """The launcher's end: starts the server, asks it for services, and learns when each one exits."""

    def __init__(self, env: Mapping[str, str], log_path: Path, title: str):
        self.env = dict(env)
        ours, theirs = socket.socketpair()
        log_path.parent.mkdir(parents=True, exist_ok=True)
        with log_path.open("ab") as log:
            self.proc = subprocess.Popen(
                [sys.executable, "-m", "asyncrlhf.forkserver", str(theirs.fileno()), title], env=self.env,
                stdin=subprocess.DEVNULL, stdout=log, stderr=subprocess.STDOUT, pass_fds=(theirs.fileno(),),
                start_new_session=True)  # a Ctrl-C to `up` is `up`'s to handle, as for the services
        theirs.close()
        self.sock, self.log_path = ours, log_path
        self.exits: dict[int, int] = {}
        self.gone = False
        self._buffer = b""
        self._started: list[int] = []
        self._ready = False

    def ready(self, timeout: float = START_TIMEOUT_S) -> None:
        """Wait until the server has imported what it preloads; raises ServerGone if it died doing so."""
        deadline = time.monotonic() + timeout
        while not self._ready:
            if self.gone or time.monotonic() > deadline:
                self.close()
                raise ServerGone(f"the fork server did not start; see {self.log_path}")
            self.pump(min(1.0, max(0.0, deadline - time.monotonic())))

    def spawn(self, module: str, args: list[str], env: Mapping[str, str], log: Path, title: str) -> Forked:
        self.ready()
        request = {"module": module, "args": args, "env": dict(env), "log": str(log), "title": title}
        try:
            self.sock.sendall(json.dumps(request).encode() + b"\n")
        except OSError as err:
            self.gone = True
            raise ServerGone(f"the fork server is gone ({err}); see {self.log_path}") from err
        while not self._started:
            if self.gone:
                raise ServerGone(f"the fork server exited; see {self.log_path}")
            self.pump(1.0)
        return Forked(self, self._started.pop(0))

    def pump(self, timeout: float) -> None:
        """Read what the server said within `timeout` seconds."""
        if self.gone:
            return
        if not select.select([self.sock], [], [], timeout)[0]:
            return
        data = self.sock.recv(1 << 16)
        if not data:
            self.gone = True
            return
        self._buffer += data
        *lines, self._buffer = self._buffer.split(b"\n")
        for line in lines:
            said = json.loads(line)
            if "ready" in said:
                self._ready = True
            elif "started" in said:
                self._started.append(said["started"])
            elif "exited" in said:
                self.exits[said["exited"]] = said["code"]

    def close(self) -> None:
        """Stop the server (the services it forked are not its to stop: the launcher stops them first)."""
        self.sock.close()
        try:
            self.proc.wait(10)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()
        self.gone = True


class Forked:
    """A service forked by the server: what the launcher uses of `subprocess.Popen` (pid, poll, wait)."""

    def __init__(self, server: ForkServer, pid: int):
        self.server, self.pid = server, pid
        self.returncode: int | None = None

    def poll(self) -> int | None:
        self.server.pump(0)
        return self._code()

    def wait(self, timeout: float | None = None) -> int:
        deadline = None if timeout is None else time.monotonic() + timeout
        while (code := self._code()) is None:
            left = 1.0 if deadline is None else deadline - time.monotonic()
            if left <= 0:
                raise subprocess.TimeoutExpired(f"pid {self.pid}", timeout or 0)
            self.server.pump(min(left, 1.0))
        return code

    def _code(self) -> int | None:
        if self.returncode is None and self.pid in self.server.exits:
            self.returncode = self.server.exits.pop(self.pid)
        if self.returncode is None and self.server.gone and not _alive(self.pid):
            # the server died before it could say how this child ended: it ended, its code is lost
            self.returncode = -signal.SIGKILL
        return self.returncode


def _alive(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except (OSError, IndexError):
        return False
    return state != "Z"


# ---------------------------------------------------------------------------------------------------------
# The server's end (`python -m asyncrlhf.forkserver FD TITLE`)


def _send(sock: socket.socket, message: dict) -> None:
    try:
        sock.sendall(json.dumps(message).encode() + b"\n")
    except OSError:
        pass  # the launcher is gone; the services it started go on, as plain processes would


def _reap(sock: socket.socket) -> None:
    while True:
        try:
            pid, status = os.waitpid(-1, os.WNOHANG)
        except ChildProcessError:
            return
        if pid == 0:
            return
        code = os.waitstatus_to_exitcode(status)
        _send(sock, {"exited": pid, "code": code})
        print(f"asyncrlhf fork server: pid {pid} exited with {code}", flush=True)


def serve(sock: socket.socket) -> dict:
    """Fork a child per request until the launcher closes its end; returns only in a child, with its
    request."""
    wake_r, wake_w = os.pipe()
    os.set_blocking(wake_r, False)
    os.set_blocking(wake_w, False)
    signal.set_wakeup_fd(wake_w)
    signal.signal(signal.SIGCHLD, lambda *_: None)
    _send(sock, {"ready": os.getpid()})
    buffer = b""
    while True:
        readable = select.select([sock.fileno(), wake_r], [], [])[0]
        if wake_r in readable:
            while True:
                try:
                    if not os.read(wake_r, 512):
                        break
                except BlockingIOError:
                    break
            _reap(sock)
        if sock.fileno() not in readable:
            continue
        data = sock.recv(1 << 16)
        if not data:
            _reap(sock)
            os._exit(0)  # the launcher is done (or gone)
        buffer += data
        *lines, buffer = buffer.split(b"\n")
        for line in lines:
            request = json.loads(line)
            sys.stdout.flush()
            sys.stderr.flush()
            pid = os.fork()
            if pid == 0:
                signal.set_wakeup_fd(-1)
                signal.signal(signal.SIGCHLD, signal.SIG_DFL)
                for fd in (wake_r, wake_w):
                    os.close(fd)
                sock.close()
                return request
            _send(sock, {"started": pid})
            print(f"asyncrlhf fork server: started {request['module']} as pid {pid}", flush=True)


def _become(request: dict, loaded_env: Mapping[str, str]) -> None:
    """Make this forked child the service `request` names: its session, log, environment, title, threads."""
    os.setsid()
    log = os.open(request["log"], os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
    os.dup2(log, 1)
    os.dup2(log, 2)
    os.close(log)
    env = {**loaded_env, **request["env"]}
    os.environ.clear()
    os.environ.update(env)
    try:
        import setproctitle

        setproctitle.setproctitle(request["title"])
    except ImportError:  # only `ps` shows the difference
        pass
    if threads := env.get("OMP_NUM_THREADS"):
        import torch

        torch.set_num_threads(int(threads))
    sys.argv = [request["module"], *request["args"]]


def main(argv: list[str]) -> int:
    sock = socket.socket(fileno=int(argv[0]))
    started = dict(os.environ)
    try:
        import setproctitle

        setproctitle.setproctitle(argv[1])
    except ImportError:
        pass
    for name, importer in PRELOAD:
        try:
            importer()
        except ImportError as err:  # an optional library missing: the service that needs it says so
            print(f"asyncrlhf fork server: not preloaded: {name} ({err})", flush=True)
    # what the imports set in the environment stays in every child, as it would in a process of its own
    added = {k: v for k, v in os.environ.items() if k not in started}
    request = serve(sock)
    _become(request, added)
    runpy.run_module(request["module"], run_name="__main__", alter_sys=True)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))

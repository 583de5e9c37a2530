"""The processes `asyncrlhf up` supervises: `Service`, one service's process (started by the fork server or
as a process of its own, polled, signalled; after a crash, the restart its policy allows and how it
crashed), and `stop_services`, which stops them all within 30 s and ends what each left behind.
The launcher (`asyncrlhf.launcher`) plans them and decides what a crash means for the run."""

from __future__ import annotations

import os
import signal
import subprocess
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path

from asyncrlhf.engine_lifetime import end_group
from asyncrlhf.forkserver import Forked, ForkServer, ServerGone
from asyncrlhf.stalls import crashes
from asyncrlhf.supervision import Restart, RestartPolicy

STOP_GRACE_S = 27.0  # run.stop_timeout_s (<= 25) plus a margin: `up` stops within 30 s


@dataclass
class Service:
    """One supervised process."""

    name: str  # e.g. "generator-0"
    kind: str  # generator | reward | learner | evaluator
    argv: list[str]
    env: dict[str, str]
    log_path: Path
    port: int
    proc: subprocess.Popen | Forked | None = None
    forks: ForkServer | None = None  # the fork server that starts it, if one does (`fork_server`)
    restarts: int = 0
    policy: RestartPolicy = field(default_factory=lambda: RestartPolicy(0, 1.0))
    pending: Restart | None = None  # a restart waiting for its back-off
    started_at: float = 0.0  # time.monotonic() of the last start
    log_offset: int = 0  # where the last start's output begins in the log
    exited_at: float = float("-inf")  # time.monotonic() of its last crash
    exit_note: str = ""  # how it crashed last, and why (`asyncrlhf.stalls.crashes`)

    def start(self) -> None:
        if self.proc is not None:  # a restart: first what the last run left (an engine it was starting)
            end_group(self.proc.pid)
        self.started_at = time.monotonic()
        self.log_offset = self.log_path.stat().st_size if self.log_path.exists() else 0
        self.log_path.parent.mkdir(parents=True, exist_ok=True)
        if self.forks is not None and not self.forks.gone:
            self.log_path.touch()
            try:
                self.proc = self.forks.spawn(self.argv[2], self.argv[3:], self.env, self.log_path,
                                             " ".join(self.argv))
                return
            except ServerGone as gone:
                print(f"asyncrlhf up: {gone}; starting {self.name} as a process of its own", flush=True)
        with self.log_path.open("ab") as log:
            self.proc = subprocess.Popen(self.argv, env=self.env, stdout=log, stderr=subprocess.STDOUT,
                                         start_new_session=True)

    def start_if_due(self) -> None:
        """Start the restart waiting for its back-off, once the back-off is over."""
        if self.pending is not None and time.monotonic() >= self.pending.at:
            self.pending = None
            self.start()

    def restart_after(self, code: int) -> Restart | None:
        """After a crash with exit `code`: the restart its policy allows, scheduled, with how it crashed noted
        (`exit_note`); None when the policy's cap is reached."""
        restart = self.policy.on_crash(time.monotonic(), time.monotonic() - self.started_at)
        if restart is None:
            return None
        self.restarts += 1
        self.pending = restart
        self.exited_at = time.monotonic()
        why = crashes.reason(crashes.last_run(self.log_path, self.log_offset))
        self.exit_note = crashes.exit_note(code, self.exited_at - self.started_at, restart.count,
                                           self.policy.window_s, why)
        return restart

    def poll(self) -> int | None:
        """The exit code, or None while the process runs."""
        return self._started().poll()

    def wait(self, timeout: float | None = None) -> int:
        return self._started().wait(timeout)

    def _started(self) -> subprocess.Popen | Forked:
        if self.proc is None:
            raise RuntimeError(f"service {self.name} was never started")
        return self.proc

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def tail(self, lines: int = 25) -> str:
        text = self.log_path.read_text(errors="replace") if self.log_path.exists() else ""
        return "\n".join(text.splitlines()[-lines:])

    def signal(self, sig: int) -> None:
        if self.proc and self.proc.poll() is None:
            try:
                os.killpg(self.proc.pid, sig)
            except ProcessLookupError:
                pass


def stop_services(services: Sequence[Service], grace_s: float = STOP_GRACE_S) -> None:
    """SIGTERM to every service at once, the learner first (it checkpoints on SIGTERM, within
    `run.stop_timeout_s`, after which each service exits by itself); SIGKILL what is left at `grace_s`, so
    `up` stops within 30 s whatever the services are blocked in. Then whatever a service left in its process
    group is ended: a generator stopped while its vLLM engine was starting leaves the engine there (the engine
    watches its generator only once it has started), and it would go on holding its memory and cores."""
    order = sorted(services, key=lambda s: s.kind != "learner")
    for svc in order:
        svc.pending = None
        svc.signal(signal.SIGTERM)
    deadline = time.monotonic() + grace_s
    for svc in order:
        if svc.proc:
            try:
                svc.proc.wait(timeout=max(0.1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                svc.signal(signal.SIGKILL)
                svc.proc.wait()
            end_group(svc.proc.pid)

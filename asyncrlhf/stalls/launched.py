"""What only `asyncrlhf up` sees, put to its stall monitor: which of the processes it runs do not answer
/metrics, and which exited since they last answered (or never did), with why (`crashes`). The launcher's
processes and its scrapes come in as the protocols below: the stall judgement sits below the launcher and
its progress display (`asyncrlhf.progress` shows a `Stall`), and imports neither."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Protocol

from asyncrlhf.stalls.diagnosis import Stall
from asyncrlhf.stalls.monitor import StallMonitor
from asyncrlhf.stalls.waiting import Waiting
from asyncrlhf.supervision import Restart


class Supervised(Protocol):
    """A process the launcher runs (`asyncrlhf.processes.Service`), as the stall judgement reads it."""

    name: str
    kind: str
    pending: Restart | None  # a restart waiting for its back-off
    exited_at: float  # time.monotonic() of its last crash
    exit_note: str  # how it crashed last, and why

    def poll(self) -> int | None: ...


class Scrapes(Protocol):
    """The run as the launcher's scrapes of /metrics last saw it (`asyncrlhf.progress.RunState`)."""

    waiting: dict[str, Waiting]  # what each service waits on, as it last said
    answered_at: dict[str, float]  # when each service last answered

    def stepless_s(self) -> float: ...

    def silent_s(self, name: str, starting: bool = False) -> float | None: ...


def judge_stall(monitor: StallMonitor | None, state: Scrapes,
                services: Sequence[Supervised]) -> Stall | None:
    """The monitor's judgement, with what only the launcher sees: which processes run and answer, and which
    crashed since they last answered (restarting, or started again and not answering yet)."""
    learner = next(s for s in services if s.kind == "learner")
    if monitor is None:
        return None
    running = [s for s in services if s.pending is None and s.poll() is None]
    silent = [(s.name, state.silent_s(s.name)) for s in running if s is not learner]
    learner_silent = state.silent_s(learner.name, starting=True) if learner in running else None
    not_starting = [f"{s.name} {s.exit_note}" for s in services
                    if s.exit_note and s.exited_at > state.answered_at.get(s.name, float("-inf"))]
    return monitor.check(state.stepless_s(), state.waiting.get(learner.name), learner_silent,
                         [(name, seconds) for name, seconds in silent if seconds is not None], not_starting)

"""What a service waits on, and since when: the state behind each service's gauge
`asyncrlhf_<service>_waiting_since_seconds{on}` (the Unix time the wait began; no series while it works).

A service's loop sets it around the calls that can wait; its /metrics and the learner's stall monitor read
it from other threads. A frozen service cannot update it, which is why the launcher and the alerts also
look at who stops answering (asyncrlhf.stalls.diagnosis).
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from enum import StrEnum

from prometheus_client import Gauge


class Wait(StrEnum):
    """What a service can wait on: the label `on` of its waiting gauge."""

    PROMPTS = "prompts"  # generator: no prompt group to sample
    WEIGHTS = "weights"  # generator: no weight push yet (nothing is generated before the first)
    ROLLOUTS = "rollouts"  # reward: no rollout group to score
    SCORED_GROUPS = "scored_groups"  # learner: a step's worth of scored groups
    PUSH = "push"  # learner: a weight push to the generators
    CHECKPOINTS = "checkpoints"  # evaluator: the next checkpoint event
    REDIS = "redis"  # any: Redis does not answer (its client is reconnecting)


@dataclass(frozen=True)
class Waiting:
    """One wait: on what, since when (Unix time), and any detail worth a message (push targets)."""

    on: Wait
    since: float
    detail: str = ""

    def seconds(self, now: float) -> float:
        return max(0.0, now - self.since)


class WaitState:
    """The current wait of one service (None while it works), mirrored into `gauge` when given."""

    def __init__(self, gauge: Gauge | None = None, clock: Callable[[], float] = time.time):
        self.gauge, self.clock = gauge, clock
        self._lock = threading.Lock()
        self._current: Waiting | None = None

    @property
    def current(self) -> Waiting | None:
        return self._current

    def wait(self, on: Wait, detail: str = "") -> None:
        """Waiting on `on` from now, unless already waiting on it (the wait keeps its start)."""
        current = self._current
        if current is not None and current.on is on and current.detail == detail:
            return
        self._set(Waiting(on, self.clock(), detail))

    def work(self) -> None:
        """Not waiting: doing the service's own work."""
        if self._current is not None:
            self._set(None)

    @contextmanager
    def waiting(self, on: Wait, detail: str = "") -> Iterator[None]:
        """Waiting on `on` for the block; then back to the wait it interrupted (same start), or to work."""
        before = self._current
        self.wait(on, detail)
        try:
            yield
        finally:
            self._set(before)

    def _set(self, waiting: Waiting | None) -> None:
        with self._lock:
            self._current = waiting
            if self.gauge is not None:
                self.gauge.clear()
                if waiting is not None:
                    self.gauge.labels(waiting.on.value).set(waiting.since)

"""What a judge reports as it works: the `JudgeMeter` protocol the reward service implements with its
Prometheus metrics (services/reward/metrics.py), and `NullMeter` for callers that keep no metrics."""

from __future__ import annotations

from typing import Literal, Protocol

Outcome = Literal["answered", "timeout", "failed"]


class JudgeMeter(Protocol):
    def started(self, calls: int) -> None:
        """`calls` more judge calls are in flight."""

    def ended(self, calls: int, seconds: float, outcome: Outcome) -> None:
        """`calls` calls ended together after `seconds` (an endpoint request: 1; an engine batch: its
        size)."""

    def parse_failed(self, replies: int) -> None:
        """Replies that held no value (each scored `parse_fail_reward`)."""

    def cache_hits(self, hits: int) -> None:
        """Requests answered from the cache, without a call."""


class NullMeter:
    def started(self, calls: int) -> None:
        pass

    def ended(self, calls: int, seconds: float, outcome: Outcome) -> None:
        pass

    def parse_failed(self, replies: int) -> None:
        pass

    def cache_hits(self, hits: int) -> None:
        pass

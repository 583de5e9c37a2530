"""Controlled staleness (`learner.staleness_mode: exact | paper`): scored groups held back until the step
that trains them.

The schedule enqueues prompts only while a version that generates is current (`algorithms.generates`), and
does not hand a step's batch to training before every enqueued group has arrived, so no group is generated
across a weight push: each carries the version that was current when it was enqueued (the window). A group
of any other version (a generator that missed a push) is dropped as off-schedule and replaced while the
window is open. Held groups stay pending in the scored stream (acked when trained); `keep` stops the stream
from re-claiming them as stalled.
"""

from __future__ import annotations

import time

from asyncrlhf.streams import Consumer, Delivery
from asyncrlhf.streams.consumer import hold


class HeldGroups:
    """Admitted groups not trained yet, by group id."""

    def __init__(self, consumer: Consumer, claim_idle_ms: int):
        self.consumer = consumer
        self.keep_every_s = claim_idle_ms / 4000
        self._held: dict[str, Delivery] = {}
        self._kept = time.monotonic()

    def __len__(self) -> int:
        return len(self._held)

    def __contains__(self, group_id: str) -> bool:
        return group_id in self._held

    def add(self, delivery: Delivery) -> None:
        self._held[delivery.identity] = delivery

    def count(self, version: int) -> int:
        return sum(d.message.policy_version == version for d in self._held.values())

    def take(self, version: int, n: int) -> list[Delivery]:
        """The `n` held groups of `version` with the lowest ids (the dataset order), no longer held."""
        ids = sorted(i for i, d in self._held.items() if d.message.policy_version == version)[:n]
        return [self._held.pop(i) for i in ids]

    def keep(self) -> None:
        """Reset the held entries' idle time, well before `claim_idle_ms` would let them be re-claimed."""
        now = time.monotonic()
        if now - self._kept >= self.keep_every_s:
            hold(self.consumer, list(self._held.values()))
            self._kept = now

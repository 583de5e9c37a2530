"""Controlled staleness (`learner.staleness_mode: exact | paper`): scored groups held back until the step
that trains them.

Prompts are enqueued only while a version that generates is current (`algorithms.generates`), and the next
version is not pushed before every group enqueued under the current one has arrived (`settle`), so no group
is generated across a weight push: each carries the version that was current when it was enqueued (the
window). A step that trains an earlier window's groups (exact, N >= 1, after the first step) trains while
the current window generates, as an asynchronous run does; a step that trains its own window's groups
(N = 0, the paper's cycles) waits for them first. A group of any other version (a generator that missed a
push) is dropped as off-schedule and replaced while the window is open. Held groups stay pending in the
scored stream (acked when trained); `keep` stops the stream from re-claiming them as stalled.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import KeysView, Set

from asyncrlhf.algorithms import generates, generating_version, staleness_decision
from asyncrlhf.config.learner import LearnerBase
from asyncrlhf.inbox.admission import Action
from asyncrlhf.inbox.strategy import Desk, StepBatch, WhileWaiting
from asyncrlhf.streams import Consumer, Delivery
from asyncrlhf.streams.consumer import Keeper

log = logging.getLogger("asyncrlhf.learner")


def window(version: int, lc: LearnerBase) -> int:
    """The version whose window is open at `version`: the last one that generates."""
    while not generates(version, lc.max_staleness, lc.staleness_mode):
        version -= 1
    return version


def refuse_resume(lc: LearnerBase, run: str, steps: int, cursor: int) -> None:
    """A controlled run cannot resume mid-way: its held-back groups were lost with the process. Called before
    a learner start writes anything."""
    if lc.staleness_mode != "bound" and (steps > 0 or cursor > 0):
        raise RuntimeError(
            f"learner.staleness_mode={lc.staleness_mode} cannot resume run {run!r} mid-way (its held-back "
            "groups were lost with the process, so staleness would not be exact): start a new run (a new "
            "run.name and run.dir)"
        )


class HeldGroups:
    """Admitted groups not trained yet, by group id."""

    def __init__(self, consumer: Consumer, claim_idle_ms: int):
        self.keeper = Keeper(consumer, claim_idle_ms)
        self._held: dict[str, Delivery] = {}

    def __len__(self) -> int:
        return len(self._held)

    def ids(self) -> KeysView[str]:
        return self._held.keys()

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
        self.keeper.keep(list(self._held.values()))


class Windowed:
    def __init__(self, lc: LearnerBase, held: HeldGroups):
        self.lc, self.held = lc, held

    def enqueues(self, version: int) -> bool:
        return generates(version, self.lc.max_staleness, self.lc.staleness_mode)

    def holding(self) -> Set[str]:
        return set(self.held.ids())

    def collect(self, desk: Desk, version: int, stop: threading.Event,
                while_waiting: WhileWaiting) -> StepBatch | None:
        """Wait until every enqueued group has arrived (none is generated across the coming push) when the
        step trains its own window's groups, else only until its source's groups are held; then take the
        step's groups from those of their generating version."""
        lc = self.lc
        source = generating_version(version, lc.max_staleness, lc.staleness_mode)
        # an earlier window is complete (its push waited for it): train while this version's window generates
        overlap = source != window(version, lc)
        while True:
            if stop.is_set():
                return None
            desk.tick(version, while_waiting)
            outstanding = desk.in_flight - len(self.held)
            if overlap and self.held.count(source) >= lc.groups_per_step:
                break
            if outstanding <= 0:
                if self.held.count(source) >= lc.groups_per_step:
                    break
                if desk.exhausted:
                    log.info("the prompt set is exhausted (learner.data_epochs=%d)", lc.data_epochs)
                    return None
                raise RuntimeError(
                    f"controlled staleness: version {version} needs {lc.groups_per_step} groups of version "
                    f"{source}, {self.held.count(source)} are left and none is in flight"
                )
            self._admit_arrivals(desk, version, outstanding)
        deliveries = self.held.take(source, lc.groups_per_step)
        decision = staleness_decision(source, version, lc.max_staleness, lc.stale_policy)
        return StepBatch(deliveries, [decision] * len(deliveries))

    def settle(self, desk: Desk, version: int, trained: int, stop: threading.Event,
               while_waiting: WhileWaiting) -> None:
        """Before the push that ends window `version`: wait until every group enqueued under it has arrived
        (and is held), replacing dropped ones under the same window, so none is generated across the push.
        `trained`: the groups of the step just trained, whose credits are freed only after the push."""
        while (outstanding := desk.in_flight - trained - len(self.held)) > 0 and not stop.is_set():
            desk.tick(version, while_waiting)
            self._admit_arrivals(desk, version, outstanding)

    def _admit_arrivals(self, desk: Desk, version: int, outstanding: int) -> None:
        open_window = window(version, self.lc)
        for delivery in desk.read(outstanding):
            if desk.receive(delivery, version, open_window, self.held.ids()).action is Action.HOLD:
                self.held.add(delivery)
        self.held.keep()

"""Controlled staleness (`learner.staleness_mode: exact | paper`): scored groups held back until the step
that trains them.

The schedule enqueues prompts only while a version that generates is current (`algorithms.generates`), and
does not push the next version before every group enqueued under the current one has arrived (`settle`), so
no group is generated across a weight push: each carries the version that was current when it was enqueued
(the window). A step that trains an earlier window's groups (exact, N >= 1, after the first step) trains
while the current window generates, as an asynchronous run does; a step that trains its own window's groups
(N = 0, the paper's cycles) waits for them first. A group of any other version (a generator that missed a
push) is dropped as off-schedule and replaced while the window is open. Held groups stay pending in the
scored stream (acked when trained); `keep` stops the stream from re-claiming them as stalled.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from typing import TYPE_CHECKING

from asyncrlhf.algorithms import StalenessDecision, generates, generating_version, staleness_decision
from asyncrlhf.streams import Consumer, Delivery
from asyncrlhf.streams.consumer import hold
from asyncrlhf.training.batch import validate_group

if TYPE_CHECKING:
    from services.learner.schedule import Schedule

log = logging.getLogger("asyncrlhf.learner")


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


def collect_held(schedule: Schedule, version: int, stop: threading.Event,
                 while_waiting: Callable[[], None]) -> tuple[list[Delivery], StalenessDecision] | None:
    """Controlled staleness: wait until every enqueued group has arrived (none is generated across the
    coming push) when the step trains its own window's groups, else only until its source's groups are held;
    then take the step's groups from those of their generating version."""
    lc = schedule.cfg.learner
    source = generating_version(version, lc.max_staleness, lc.staleness_mode)
    # an earlier window is complete (its push waited for it): train while this version's window generates
    overlap = source != window(version, lc)
    waited = time.perf_counter()
    while True:
        if stop.is_set():
            return None
        schedule._fill(version)
        while_waiting()
        schedule._reap_dead_letters(version)
        schedule._observe_queues()
        outstanding = schedule.credits.in_flight - len(schedule.held)
        if overlap and schedule.held.count(source) >= lc.groups_per_step:
            break
        if outstanding <= 0:
            if schedule.held.count(source) >= lc.groups_per_step:
                break
            if schedule.feed.exhausted:
                log.info("the prompt set is exhausted (learner.data_epochs=%d)", lc.data_epochs)
                return None
            raise RuntimeError(
                f"controlled staleness: version {version} needs {lc.groups_per_step} groups of version "
                f"{source}, {schedule.held.count(source)} are left and none is in flight"
            )
        _admit_arrivals(schedule, version, outstanding)
    schedule.metrics.wait.inc(time.perf_counter() - waited)
    deliveries = schedule.held.take(source, lc.groups_per_step)
    return deliveries, staleness_decision(source, version, lc.max_staleness, lc.stale_policy)


def _admit_arrivals(schedule: Schedule, version: int, outstanding: int) -> None:
    for delivery in schedule.consumer.read(outstanding):
        admit_held(schedule, delivery, version)
    schedule.held.keep()


def settle_held(schedule: Schedule, version: int, trained: int, stop: threading.Event,
                while_waiting: Callable[[], None]) -> None:
    """Before the push that ends window `version`: wait until every group enqueued under it has arrived
    (and is held), replacing dropped ones under the same window, so none is generated across the push.
    `trained`: the groups of the step just trained, whose credits are freed only after the push."""
    waited = time.perf_counter()
    while (outstanding := schedule.credits.in_flight - trained - len(schedule.held)) > 0 \
            and not stop.is_set():
        schedule._fill(version)
        while_waiting()
        schedule._reap_dead_letters(version)
        _admit_arrivals(schedule, version, outstanding)
    schedule.metrics.wait.inc(time.perf_counter() - waited)


def window(version: int, lc) -> int:
    """The version whose window is open at `version`: the last one that generates."""
    while not generates(version, lc.max_staleness, lc.staleness_mode):
        version -= 1
    return version


def admit_held(schedule: Schedule, delivery: Delivery, version: int) -> None:
    lc = schedule.cfg.learner
    if delivery.identity in schedule.consumed.ids:
        schedule.consumer.ack([delivery])
        return
    if delivery.identity in schedule.held:  # re-claimed: the same entry
        schedule.held.add(delivery)
        return
    problem = validate_group(delivery.message, schedule.cfg.generator.samples_per_prompt)
    if problem:
        schedule.consumer.dead_letter(delivery, f"learner cannot train on it: {problem}")
        return
    open_window = window(version, lc)
    generated_by = delivery.message.policy_version
    if generated_by == open_window:
        schedule.held.add(delivery)
        return
    log.warning("group %s generated by version %d, enqueued under %d: dropped (off-schedule)",
                delivery.identity, generated_by, open_window)
    schedule.consumed.append("dropped", version, [delivery.identity],
                         staleness=version - generated_by, reason="off-schedule")
    schedule.consumer.ack([delivery])
    schedule.metrics.groups.labels("dropped").inc()
    schedule._finish(1, f"dropped:{delivery.identity}")

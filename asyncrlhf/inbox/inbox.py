"""Rank 0's inbox: prompts enqueued under the in-flight bound, scored groups read and admitted, groups ended.

A scored group is admitted once (`asyncrlhf.inbox.admission`). A group ends when it is trained, dropped,
filtered or dead-lettered (`asyncrlhf.inbox.endings`: its consumed-log row, its ack, its metric and its
credit, released under one token); that frees its credit, so the feed enqueues the next prompt. In flight =
enqueued - ended; both counters live in Redis and survive a restart. The tick keeps house while a step
waits: a Redis restart or failover is repaired from the consumed log, prompts are enqueued, dead letters
reaped, queues observed. How a step is collected is the staleness mode's strategy (`Bounded`, or `Windowed`
for `exact` and `paper`).

A trained step's credits are freed after its push: by the learner's thread after a synchronous one, by the
push's own thread the moment a background one completes (`release_after_push`), whatever the learner is
doing then. Left to the learner's next tick, they waited whenever the push ended after the step's last read:
through the whole next training step, with the generators out of prompts (the demo's async1 ran at 9 s a
step against 7 with the push synchronous). A lock keeps that release and the tick's enqueueing apart.
"""

from __future__ import annotations

import logging
import threading
import time
import uuid
from collections.abc import Callable, Set
from dataclasses import replace

from asyncrlhf.algorithms import filter_reason
from asyncrlhf.config import Config
from asyncrlhf.consumed import ConsumedLog, Kind, log_path
from asyncrlhf.inbox.admission import Action, Known, Rules, Verdict, admit
from asyncrlhf.inbox.bounded import Bounded
from asyncrlhf.inbox.endings import Endings, trained_row
from asyncrlhf.inbox.feed import PromptFeed
from asyncrlhf.inbox.ids import enqueued_below
from asyncrlhf.inbox.metrics import InboxMetrics, record_judged
from asyncrlhf.inbox.prompts import PromptSet
from asyncrlhf.inbox.recovery import Recovery, RedisWatch
from asyncrlhf.inbox.strategy import StepBatch, Strategy, WhileWaiting
from asyncrlhf.inbox.windowed import HeldGroups, Windowed, refuse_resume
from asyncrlhf.streams import (
    FEED_CURSOR,
    FLOW,
    LEARNER_FINISHED,
    LEARNER_GROUP,
    PROMPTS,
    SCORED,
    Delivery,
    RunStreams,
)
from asyncrlhf.streams.consumer import Keeper
from asyncrlhf.training.checkpoint import LearnerState
from asyncrlhf.version import PolicyVersion

log = logging.getLogger("asyncrlhf.learner")


def admission_rules(cfg: Config) -> Rules:
    """What the inbox admits groups by (`learner.dynamic_sampling`: filter uninformative groups)."""
    lc = cfg.learner
    reason = filter_reason(lc.algorithm) if lc.dynamic_sampling.enabled else None
    return Rules(cfg.generator.samples_per_prompt, lc.max_staleness, lc.stale_policy, filter_reason=reason)


class Inbox:
    def __init__(self, cfg: Config, streams: RunStreams, prompts: PromptSet, state: LearnerState,
                 metrics: InboxMetrics, resumed: bool = False):
        lc = cfg.learner
        self.cfg, self.client, self.streams, self.metrics = cfg, streams.client, streams, metrics
        credits = streams.credits((lc.max_staleness + 1) * lc.groups_per_step)
        self.feed = PromptFeed(self.client, streams.producer(PROMPTS), credits, prompts,
                               data_epochs=lc.data_epochs, cursor_key=streams.key(FEED_CURSOR))
        refuse_resume(lc, cfg.run.name, state.steps, self.feed.cursor)  # before anything is written
        self.consumer = streams.consumer(SCORED, LEARNER_GROUP, f"learner-{uuid.uuid4().hex[:6]}")
        self.consumed = ConsumedLog(log_path(cfg.run.path))
        self.replica_wait = streams.replica_wait()  # WAIT after critical writes (redis.sentinel)
        self._finished_key = streams.key(LEARNER_FINISHED)
        # A new lineage continues the checkpoint's (or fresh weights): groups trained after it are retrained.
        state.lineage = self.consumed.begin(state.lineage if resumed else 0, state.version if resumed else 0)
        self.lineage = self.feed.lineage = state.lineage
        metrics.lineage.set(state.lineage)
        self.recovery = Recovery(streams, self.feed, self.consumed, self._finished_key, metrics)
        self.recovery.run(state.cursor, state.version)
        self.endings = Endings(streams, self.consumer, self.feed, self.recovery, metrics, state.lineage)
        self.watch = RedisWatch(self.client)
        self.strategy: Strategy = (Bounded(lc) if lc.staleness_mode == "bound"
                                   else Windowed(lc, HeldGroups(self.consumer, cfg.redis.claim_idle_ms)))
        self.rules = admission_rules(cfg)
        self._awaiting: int | None = None  # the version whose background push is in flight
        self._enqueueing = threading.Lock()  # a push's thread releases while the learner's ticks
        self.keep = Keeper(self.consumer, cfg.redis.claim_idle_ms).keep  # a step's reads, while it collects

    @property
    def known_cursor(self) -> int:
        """The feed cursor as this learner last wrote or read it (no Redis call)."""
        return self.feed.known_cursor

    @property
    def known_finished(self) -> int:
        """Groups below the cursor that ended, from the consumed log (no Redis call)."""
        return sum(1 for g in self.consumed.ids if enqueued_below(g, self.feed.known_cursor))

    @property
    def finished(self) -> int:
        return int(self.client.get(self._finished_key) or 0)

    @property
    def in_flight(self) -> int:
        return self.feed.credits.in_flight

    @property
    def exhausted(self) -> bool:
        return self.feed.exhausted

    # -- a step: collect, (train), trained, settle, (push), release (after a background push: when it ends) --

    def collect(self, version: int, stop: threading.Event, while_waiting: WhileWaiting) -> StepBatch | None:
        """A step's worth of admitted groups, ticking (and `while_waiting`) between reads; None at the end."""
        waited = time.perf_counter()
        batch = self.strategy.collect(self, version, stop, while_waiting)
        if batch is not None:
            self.metrics.wait.inc(time.perf_counter() - waited)
        return batch

    def trained(self, batch: StepBatch, version: int) -> None:
        """Record a trained step (fsynced) and ack its entries; `version` is the one its update produced."""
        assert self._awaiting is None, "the last step's credits still wait for its push: one step at a time"
        self.endings.end(Kind.TRAINED, version, batch.ids(), batch.deliveries, **trained_row(batch))

    def settle(self, batch: StepBatch, version: int, stop: threading.Event,
               while_waiting: WhileWaiting) -> None:
        """Before pushing the version after `version` (`batch` trained, its credits not yet freed): what the
        strategy waits for (a controlled mode: every group enqueued under `version`)."""
        waited = time.perf_counter()
        self.strategy.settle(self, version, len(batch.deliveries), stop, while_waiting)
        self.metrics.wait.inc(time.perf_counter() - waited)

    def release(self, version: int) -> None:
        """Free the trained step's credits and enqueue the next prompts at once; then wait for the replicas
        to hold the step's Redis writes (its acks, the finished count, the new prompts and the cursor)."""
        with self._enqueueing:
            self._awaiting = None
            self.endings.release_trained()
            self._fill(version)
        self.replica_wait(f"step to version {version}")

    def release_after_push(self, version: int) -> Callable[[], None]:
        """Hold the trained step's credits, and every enqueue, while `version`'s background push is in
        flight: nothing is enqueued before the generators hold it, as after a synchronous push, so the bound
        holds. Returns what the push's thread calls when the push completes: `release(version)`."""
        self._awaiting = version
        return lambda: self.release(version)

    # -- what a strategy uses ------------------------------------------------------------------------------

    def tick(self, version: int, while_waiting: WhileWaiting) -> None:
        """Housekeeping between reads: repair a Redis restart or failover (the groups admitted and not yet
        trained count as present), enqueue what credits allow, call `while_waiting`, reap dead letters and
        observe the queues."""
        with self._enqueueing:
            if self.watch.restarted():
                self.recovery.run(self.feed.known_cursor, version, self.strategy.holding(),
                                  frozenset(self.endings.unreleased))
            filled = self._fill(version)
        if filled:
            self.replica_wait(f"enqueueing prompts at version {version}")
        while_waiting()
        self.endings.reap_dead_letters(version)
        observe_queues(self.streams, self.metrics, self.feed.credits.in_flight)

    def read(self, n: int) -> list[Delivery]:
        return self.consumer.read(n)

    def receive(self, delivery: Delivery, version: int, window: int | None = None,
                held: Set[str] = frozenset(), filtering: bool = True) -> Verdict:
        """Admit one delivery at `version` (`window`, `held`: a controlled mode's open window and held ids;
        `filtering`: whether dynamic sampling may filter it) and do what the verdict asks, except to train or
        hold it: that is the strategy's."""
        rules = self.rules if window is None else replace(self.rules, window=window)
        if not filtering:
            rules = replace(rules, filter_reason=None)
        known = Known(self.consumed.ids, self.recovery.retrain, held)
        current = PolicyVersion(self.lineage, version)
        verdict = admit(delivery.identity, delivery.message, current, rules, known)
        if verdict.decision is not None:
            record_judged(self.metrics, verdict.decision, verdict.old_lineage, delivery.message)
        if verdict.action in (Action.DUPLICATE, Action.REQUEUE):
            self.consumer.ack([delivery])
        if verdict.action is Action.REQUEUE:  # its earlier training was lost: sample it again
            self.recovery.requeue([delivery.identity], version, "stale_retrain")
        elif verdict.action is Action.INVALID:  # its credit comes back through the dead-letter scan
            self.consumer.dead_letter(delivery, verdict.reason)
        elif verdict.action in (Action.DROP, Action.FILTER):
            self._drop(delivery, version, verdict)
        return verdict

    def _drop(self, delivery: Delivery, version: int, verdict: Verdict) -> None:
        """End a group untrained: dropped (beyond the bound; `reason`: why else), or filtered by dynamic
        sampling (its credit is freed at once, so the feed enqueues its refill within the bound)."""
        kind = Kind.FILTERED if verdict.action is Action.FILTER else Kind.DROPPED
        row: dict = {"staleness": verdict.staleness, **({"reason": verdict.reason} if verdict.reason else {})}
        if kind is Kind.FILTERED:
            self.metrics.filtered.labels(verdict.reason).inc()
        elif verdict.reason:
            log.warning("group %s generated by version %d (its oldest token), read at %d: dropped (%s)",
                        delivery.identity, version - verdict.staleness, version, verdict.reason)
        self.endings.end(kind, version, [delivery.identity], [delivery], **row)

    # -- housekeeping --------------------------------------------------------------------------------------

    def _fill(self, version: int) -> int:
        """Enqueue what credits allow while the strategy enqueues at `version` and no push is awaited; how
        many groups."""
        if self._awaiting is not None or not self.strategy.enqueues(version):
            return 0
        return self.feed.fill(version)


def observe_queues(streams: RunStreams, metrics: InboxMetrics, in_flight: int) -> None:
    """Each stream's depth and consumer lag, and the groups in flight, into the metrics."""
    for spec, group in FLOW:
        s = streams.stats(spec, group)
        metrics.queue_depth.labels(spec.name).set(s.length)
        metrics.queue_lag.labels(spec.name).set(s.lag)
    metrics.in_flight.set(in_flight)

"""Rank 0's schedule: prompts enqueued under the in-flight bound, scored groups read and admitted, groups
finished.

A scored group is admitted once: de-duplicated against the consumed log (a group trained before a crash and
redelivered is acked, never trained twice), validated (else dead-lettered), and judged for staleness by
`asyncrlhf.algorithms.staleness_decision` (dropped, or admitted with the decision as part of the group). A
group finishes when it is trained, dropped or dead-lettered: that frees its credit, so the feed enqueues the
next prompt. In flight = enqueued - finished; both counters live in Redis and survive a restart.

Under a controlled `learner.staleness_mode` (exact, paper) admitted groups are held back until the step
their generating version is due (see `services.learner.held`).
"""

from __future__ import annotations

import logging
import threading
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass, field

import redis

from asyncrlhf.algorithms import StalenessDecision, generates, staleness_decision
from asyncrlhf.config import Config
from asyncrlhf.consumed import CONSUMED_LOG, ConsumedLog
from asyncrlhf.models import encode_prompts
from asyncrlhf.streams import (
    DEAD_LETTER,
    FEED_CURSOR,
    FLOW,
    LEARNER_DEAD_LETTER_CURSOR,
    LEARNER_FINISHED,
    LEARNER_GROUP,
    PROMPTS,
    SCORED,
    Delivery,
    RunStreams,
)
from asyncrlhf.tasks import fit_prompts, load_task, plain_text
from asyncrlhf.training.batch import TrainGroup, validate_group
from asyncrlhf.training.checkpoint import LearnerState
from services.learner.feed import PromptFeed, group_index
from services.learner.held import HeldGroups, collect_held, settle_held
from services.learner.metrics import LearnerMetrics
from services.learner.recovery import recover, requeue

log = logging.getLogger("asyncrlhf.learner")
_STALE_LABELS = {"keep": "kept", "correct": "corrected", "drop": "dropped"}
REDIS_CHECK_S = 1.0  # how often the learner checks whether Redis restarted


@dataclass
class StepBatch:
    """The deliveries of one step, each with the staleness decision that admitted it."""

    deliveries: list[Delivery] = field(default_factory=list)
    decisions: list[StalenessDecision] = field(default_factory=list)

    def groups(self) -> list[TrainGroup]:
        return [TrainGroup(d.message, s) for d, s in zip(self.deliveries, self.decisions, strict=True)]

    def sorted(self) -> StepBatch:
        """In group-id order, so a step's batch does not depend on arrival order."""
        order = sorted(range(len(self.deliveries)), key=lambda i: self.deliveries[i].identity)
        return StepBatch([self.deliveries[i] for i in order], [self.decisions[i] for i in order])


class Schedule:
    def __init__(self, cfg: Config, client: redis.Redis, streams: RunStreams, tokenizer, state: LearnerState,
                 metrics: LearnerMetrics, resumed: bool = False):
        self.cfg, self.client, self.streams, self.metrics = cfg, client, streams, metrics
        self.consumer = streams.consumer(SCORED, LEARNER_GROUP, f"learner-{uuid.uuid4().hex[:6]}")
        self.consumed = ConsumedLog(cfg.run.path / CONSUMED_LOG)
        self.credits = streams.credits((cfg.learner.max_staleness + 1) * cfg.learner.groups_per_step)
        self.replica_wait = streams.replica_wait()  # WAIT after critical writes (redis.sentinel)
        task = load_task(cfg.task)
        whole = cfg.model.model_copy(update={"max_prompt_tokens": 1 << 30})  # lengths before truncation
        task, prompt_ids = fit_prompts(task, encode_prompts(tokenizer, task.train, whole),
                                       cfg.model.max_prompt_tokens, cfg.task)
        texts = [plain_text(p) for p in task.train]
        self.feed = PromptFeed(client, streams.producer(PROMPTS), self.credits, texts, prompt_ids,
                               references=task.train_references,
                               k=cfg.generator.samples_per_prompt, seed=cfg.run.seed,
                               data_epochs=cfg.learner.data_epochs, cursor_key=streams.key(FEED_CURSOR))
        self._finished_key = streams.key(LEARNER_FINISHED)
        self._dlq_cursor_key = streams.key(LEARNER_DEAD_LETTER_CURSOR)
        # A new lineage continues the checkpoint's (or fresh weights): groups trained after it lost their
        # update and are trained again.
        state.lineage = self.consumed.begin(state.lineage if resumed else 0, state.version if resumed else 0)
        self.lineage = self.feed.lineage = state.lineage
        metrics.lineage.set(state.lineage)
        self.retrain: set[str] = set()  # groups whose update was lost (set by `recover`)
        recover(self, state.cursor, state.version)
        self._redis_run_id, self._redis_checked = self._redis_identity(), time.monotonic()
        self.held = HeldGroups(self.consumer, cfg.redis.claim_idle_ms)
        if cfg.learner.staleness_mode != "bound" and (state.steps > 0 or self.feed.cursor > 0):
            raise RuntimeError(
                f"learner.staleness_mode={cfg.learner.staleness_mode} cannot resume run {cfg.run.name!r} "
                "mid-way (its held-back groups were lost with the process, so staleness would not be exact): "
                "start a new run (a new run.name and run.dir)"
            )

    def _redis_identity(self) -> str:
        return str(self.client.info("server").get("run_id", ""))

    def _after_redis_restart(self, version: int, holding: StepBatch) -> None:
        """A Redis that restarted, or a replica promoted by a failover, may lack the last writes
        (`appendfsync everysec`, no AOF, asynchronous replication): recover as at a start, the groups of the
        step being collected counted as present."""
        if time.monotonic() - self._redis_checked < REDIS_CHECK_S:
            return
        self._redis_checked = time.monotonic()
        run_id = self._redis_identity()
        if run_id == self._redis_run_id:
            return
        log.warning("Redis restarted or failed over (run id %s -> %s): checking the streams against the "
                    "consumed log", self._redis_run_id[:8], run_id[:8])
        self._redis_run_id = run_id
        recover(self, self.feed.known_cursor, version, {d.identity for d in holding.deliveries})

    @property
    def known_cursor(self) -> int:
        """The feed cursor as this learner last wrote or read it (no Redis call)."""
        return self.feed.known_cursor

    @property
    def known_finished(self) -> int:
        """Groups below the cursor that ended, from the consumed log (no Redis call)."""
        return sum(1 for g in self.consumed.ids if 0 <= group_index(g) < self.feed.known_cursor)

    @property
    def finished(self) -> int:
        return int(self.client.get(self._finished_key) or 0)

    def collect(
        self, version: int, stop: threading.Event, while_waiting: Callable[[], None]
    ) -> StepBatch | None:
        """Read scored groups until a step's worth is admitted; enqueue prompts and call `while_waiting`
        (late generators) between reads. None when stopped or the prompt set is exhausted."""
        lc = self.cfg.learner
        if lc.staleness_mode != "bound":
            held = collect_held(self, version, stop, while_waiting)
            return None if held is None else StepBatch(held[0], [held[1]] * len(held[0]))
        batch = StepBatch()
        waited = time.perf_counter()
        while len(batch.deliveries) < lc.groups_per_step:
            if stop.is_set():
                return None
            self._after_redis_restart(version, batch)
            if self._fill(version):
                self.replica_wait(f"enqueueing prompts at version {version}")
            while_waiting()
            self._reap_dead_letters(version)
            self._observe_queues()
            if self.feed.exhausted and self.credits.in_flight == 0 and not batch.deliveries:
                log.info("the prompt set is exhausted (learner.data_epochs=%d)", lc.data_epochs)
                return None
            for delivery in self.consumer.read(lc.groups_per_step - len(batch.deliveries)):
                self._admit(delivery, batch, version)
        self.metrics.wait.inc(time.perf_counter() - waited)
        return batch.sorted()

    def settle(self, batch: StepBatch, version: int, stop: threading.Event,
               while_waiting: Callable[[], None]) -> None:
        """Before pushing the version after `version` (`batch` trained, its credits not yet freed): under a
        controlled staleness mode, wait until every group enqueued under `version` has arrived (see
        `services.learner.held`)."""
        if self.cfg.learner.staleness_mode != "bound":
            settle_held(self, version, len(batch.deliveries), stop, while_waiting)

    def trained(self, batch: StepBatch, version: int) -> None:
        """Record a trained step (fsynced) and ack its entries; `version` is the one its update produced."""
        ids = [d.identity for d in batch.deliveries]
        self.consumed.append("trained", version, ids, staleness=[s.staleness for s in batch.decisions])
        self.retrain.difference_update(ids)
        self.consumer.ack(batch.deliveries)

    def release(self, batch: StepBatch, version: int) -> None:
        """Free a trained step's credits and enqueue the next prompts at once; then wait for the replicas to
        hold the step's Redis writes (its acks, the finished count, the new prompts and the cursor)."""
        self._finish(len(batch.deliveries), f"trained:{self.lineage}:{batch.deliveries[0].identity}")
        self._fill(version)
        self.replica_wait(f"step to version {version}")

    def _fill(self, version: int) -> int:
        """Enqueue what credits allow (while a generating version is current); how many groups."""
        lc = self.cfg.learner
        if lc.staleness_mode == "bound" or generates(version, lc.max_staleness, lc.staleness_mode):
            return self.feed.fill(version)
        return 0

    def _admit(self, delivery: Delivery, batch: StepBatch, version: int) -> None:
        group, lc = delivery.message, self.cfg.learner
        if delivery.identity in self.consumed.ids:  # trained before a crash, redelivered: never twice
            self.consumer.ack([delivery])
            return
        problem = validate_group(group, self.cfg.generator.samples_per_prompt)
        if problem:
            self.consumer.dead_letter(delivery, f"learner cannot train on it: {problem}")
            return  # its credit comes back through the dead-letter scan
        decision = staleness_decision(group.policy_version, version, lc.max_staleness, lc.stale_policy)
        if group.lineage and group.lineage != self.lineage:  # versions of another lineage do not compare
            beyond = max(lc.max_staleness + 1, version - group.policy_version)
            decision = staleness_decision(version - beyond, version, lc.max_staleness, lc.stale_policy)
            self.metrics.old_lineage.labels(_STALE_LABELS[decision.action]).inc()
        if decision.action != "fresh":
            self.metrics.stale.labels(_STALE_LABELS[decision.action]).inc()
        if not decision.trained and delivery.identity in self.retrain:
            # Its earlier training was lost with a learner; dropping it would leave a group logged as trained
            # in no model: sample it again from the current weights instead.
            self.consumer.ack([delivery])
            requeue(self, [delivery.identity], version, "stale_retrain")
            return
        if not decision.trained:
            self.consumed.append("dropped", version, [delivery.identity], staleness=decision.staleness)
            self.consumer.ack([delivery])
            self.metrics.groups.labels("dropped").inc()
            self._finish(1, f"dropped:{self.lineage}:{delivery.identity}")
            return
        batch.deliveries.append(delivery)
        batch.decisions.append(decision)

    def _finish(self, n: int, token: str) -> None:
        """Count `n` groups finished and free their credits, once per `token` (see `PromptCredits.release`):
        a group id of theirs, since each group finishes once (the consumed log makes sure)."""
        self.metrics.in_flight.set(self.credits.release(n, token, finished_key=self._finished_key))

    def _reap_dead_letters(self, version: int) -> None:
        """Dead-lettered groups of this run will never arrive: count them finished and free their credits."""
        cursor = self.client.get(self._dlq_cursor_key)
        # redis-py's stub says bytes | str; without decode_responses GET returns bytes
        entries = self.streams.dead_letters(count=1000, after=cursor)  # type: ignore[arg-type]
        if not entries:
            return
        streams = {spec.name for spec, _ in FLOW}
        lost = [d.identity for d in entries
                if d.stream in streams and d.identity not in self.consumed.ids
                and self.feed.enqueued(d.identity)]
        lost = list(dict.fromkeys(lost))  # one group dead-lettered twice (two copies) finishes once
        if lost:
            self.consumed.append("dead_lettered", version, lost)
            self.metrics.groups.labels("dead_lettered").inc(len(lost))
            self._finish(len(lost), f"dead_lettered:{self.lineage}:{lost[0]}")
        self.client.set(self._dlq_cursor_key, entries[-1].entry_id)
        self.metrics.dead_letters.set(self.client.xlen(self.streams.key(DEAD_LETTER)))

    def _observe_queues(self) -> None:
        for spec, group in FLOW:
            s = self.streams.stats(spec, group)
            self.metrics.queue_depth.labels(spec.name).set(s.length)
            self.metrics.queue_lag.labels(spec.name).set(s.lag)
        self.metrics.in_flight.set(self.credits.in_flight)

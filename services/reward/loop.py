"""The reward replica: read rollout groups from the `reward` consumer group, score every sample, write the
scored groups to `scored` and ack, in one atomic step per batch (so a killed replica loses or doubles
nothing: its unacked groups are re-claimed by a live one, and the ack script drops repeats).

A batch is scored in one call (one model pass over all its samples). If that fails, each group is scored
alone, `reward.retries` more times; a group that still fails is handed to `Consumer.fail`, which leaves it
pending for another try after `redis.claim_idle_ms` and dead-letters it, with the error, after
`redis.max_deliveries` deliveries. The loop keeps going either way.
"""

from __future__ import annotations

import itertools
import logging
import os
import socket
import threading
import time
from collections.abc import Sequence

import redis

from asyncrlhf._proto.rollout_pb2 import RolloutGroup
from asyncrlhf.config import Config
from asyncrlhf.models import ModelLoadError
from asyncrlhf.rewards import CompositeReward, Item, ScorerConfigError, ScoreResult, build_reward
from asyncrlhf.rewards.groups import items_of, scored
from asyncrlhf.rewards.openrlhf import QueryReader
from asyncrlhf.service import HttpServer, ServiceError, check_bind
from asyncrlhf.stalls import Wait
from asyncrlhf.streams import REWARD_GROUP, ROLLOUTS, SCORED, Consumer, Delivery, Producer, RunStreams
from services.reward.http import ServingState, create_app
from services.reward.metrics import RewardMetrics


class RewardLoop:
    def __init__(
        self,
        reward: CompositeReward,
        consumer: Consumer[RolloutGroup],
        producer: Producer[RolloutGroup],
        metrics: RewardMetrics,
        *,
        scorer_id: str,
        retries: int,
        read_groups: int,
    ):
        self.reward, self.consumer, self.producer, self.metrics = reward, consumer, producer, metrics
        self.scorer_id, self.retries, self.read_groups = scorer_id, retries, read_groups
        self.log = logging.getLogger("asyncrlhf.reward")
        self._dead_lettered = self._duplicates = 0

    def run(self, stop: threading.Event) -> None:
        while not stop.is_set():
            try:
                self.step()
            except redis.ConnectionError as err:  # the client already retried with back-off
                self.metrics.waiting.wait(Wait.REDIS)
                self.log.warning("Redis unavailable (%s); retrying", err)
                stop.wait(1.0)

    def step(self, block_ms: int | None = None) -> int:
        """Read, score, write and ack one batch; returns the groups written."""
        batch = self.consumer.read(self.read_groups, block_ms)
        written = 0
        if not batch:
            self.metrics.waiting.wait(Wait.ROLLOUTS)
        else:
            self.metrics.waiting.work()
            outputs, errors = self._score(batch)
            done = [i for i, out in enumerate(outputs) if out is not None]
            if done:
                written = self.consumer.ack(
                    [batch[i] for i in done], [outputs[i] for i in done], to=self.producer
                )
                self.metrics.groups.inc(written)
            for delivery, error in zip(batch, errors, strict=True):
                if error is not None:
                    self.consumer.fail(delivery, error)
        self._sync_counters()
        return written

    def _score(self, batch: Sequence[Delivery[RolloutGroup]]) -> tuple[list, list]:
        """(scored group or None, error or None) per delivery."""
        groups = [d.message for d in batch]
        try:
            result = self._call([items_of(g) for g in groups])
        except Exception as err:
            first = f"{type(err).__name__}: {err}" if len(groups) == 1 else None
            pairs = [self._score_alone(g, first) for g in groups]
            return [out for out, _ in pairs], [error for _, error in pairs]
        offsets = itertools.accumulate([len(g.samples) for g in groups[:-1]], initial=0)
        outputs = [scored(g, result, o, self.scorer_id) for g, o in zip(groups, offsets, strict=True)]
        return outputs, [None] * len(groups)

    def _score_alone(
        self, group: RolloutGroup, first_error: str | None
    ) -> tuple[RolloutGroup | None, str | None]:
        """Score one group, retrying; `first_error`, when given, was attempt zero."""
        error = first_error
        attempts = self.retries if first_error is not None else self.retries + 1
        for _ in range(attempts):
            try:
                return scored(group, self._call([items_of(group)]), 0, self.scorer_id), None
            except Exception as err:
                error = f"{type(err).__name__}: {err}"
        self.log.warning("group %s failed scoring: %s", group.group_id, error)
        return None, error

    def _call(self, per_group: Sequence[list[Item]]) -> ScoreResult:
        items = [it for group in per_group for it in group]
        start = time.perf_counter()
        try:
            result = self.reward.score(items)
        except Exception:
            self.metrics.errors.inc()
            raise
        self.metrics.observe(
            "stream", time.perf_counter() - start, result.scores, result.components, result.truncated
        )
        return result

    def _sync_counters(self) -> None:
        self.metrics.dead_lettered.inc(self.consumer.dead_lettered - self._dead_lettered)
        self.metrics.duplicates.inc(self.consumer.duplicates_skipped - self._duplicates)
        self._dead_lettered, self._duplicates = self.consumer.dead_lettered, self.consumer.duplicates_skipped


def replica_id() -> str:
    return f"reward-{socket.gethostname()}-{os.getpid()}"


def serve(cfg: Config, log: logging.Logger, stop: threading.Event) -> int:
    """The service's main body: HTTP up first (not ready), then scorers and Redis, then the loop."""
    if not cfg.redis.external:
        raise ServiceError("redis.url is not set: pass redis.url=redis://host:6379/0 or "
                           "redis.sentinel.addresses=[host:26379,...] (or use `asyncrlhf up`)")
    rc = cfg.reward
    check_bind(rc.http_host, cfg, "reward HTTP")
    metrics = RewardMetrics()
    state = ServingState()
    server = HttpServer(
        create_app(state, metrics, token=cfg.run.token, max_items=rc.max_request_items),
        rc.http_host,
        rc.http_port,
    ).start()
    log.info("reward HTTP on %s", server.url)
    try:
        try:
            reward = build_reward(rc, cfg.model, metrics.judge)
        except ScorerConfigError as err:
            raise ServiceError(str(err)) from err
        streams = RunStreams.from_config(cfg)
        consumer = streams.consumer(ROLLOUTS, REWARD_GROUP, replica_id())
        try:  # the policy tokenizer reads OpenRLHF queries back into the pipeline's items
            reader = QueryReader.from_config(cfg.model)
        except ModelLoadError as err:
            raise ServiceError(f"{err} (the reward service loads the policy tokenizer for /get_reward)"
                               ) from err
        state.set_ready(reward, lambda: bool(streams.client.ping()), reader)
        read_groups = max(1, rc.batch_size // cfg.generator.samples_per_prompt)
        RewardLoop(
            reward,
            consumer,
            streams.producer(SCORED),
            metrics,
            scorer_id=consumer.name,
            retries=rc.retries,
            read_groups=read_groups,
        ).run(stop)
    finally:
        server.stop()
    log.info("reward stopped")
    return 0

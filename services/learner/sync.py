"""The learner's side of WeightSync: after a step, snapshot the weights generators need (every rank joins the
gather under ZeRO-3) and push them to every live generator; between steps, bring a generator that joined
late (or restarted) to the current version at once. Push outcomes become metrics and warnings."""

from __future__ import annotations

import logging
import time

import torch

from asyncrlhf.config import Config
from asyncrlhf.registry import Registry
from asyncrlhf.training import engine
from asyncrlhf.weights.pusher import PushTarget, WeightPusher
from services.learner.metrics import LearnerMetrics

log = logging.getLogger("asyncrlhf.learner")
LATE_SYNC_PERIOD_S = 0.5


class WeightPublisher:
    def __init__(self, cfg: Config, policy, rank: int, registry: Registry | None, metrics: LearnerMetrics):
        self.cfg, self.policy, self.rank, self.registry, self.metrics = cfg, policy, rank, registry, metrics
        self.pusher = WeightPusher.from_config(cfg) if rank == 0 else None
        self.version = 0
        self._weights: dict[str, torch.Tensor] | None = None
        self._pushed: dict[str, tuple[int, float]] = {}  # generator id -> (version pushed, when)
        self._last_sync = 0.0

    def publish(self, version: int) -> None:
        """Snapshot the weights of `version` (all ranks) and push them to every live generator (rank 0)."""
        lc = self.cfg.learner
        started = time.perf_counter()
        self._weights = engine.full_state_dict(self.policy.module, lc.deepspeed.zero_stage, lc.lora.enabled)
        self.version = version
        if self.rank == 0 and self._push([PushTarget(m.id, m.address) for m in self.registry.live()]):
            self.metrics.step_to_serve.set(time.perf_counter() - started)

    def sync_late_generators(self) -> None:
        """Push the current version to live generators behind it, retrying a failed one after two beats."""
        now = time.monotonic()
        if now - self._last_sync < LATE_SYNC_PERIOD_S:
            return
        self._last_sync = now
        retry_after = 2 * self.cfg.generator.heartbeat_s
        behind = [
            PushTarget(m.id, m.address) for m in self.registry.live()
            if m.version < self.version
            and (self._pushed.get(m.id, (0, 0.0))[0] < self.version or now - self._pushed[m.id][1] > retry_after)
        ]
        if behind:
            self._push(behind)

    def close(self) -> None:
        if self.pusher is not None:
            self.pusher.close()

    def _push(self, targets: list[PushTarget]) -> bool:
        """Push the current version to `targets`; whether every one of them serves it now."""
        if not targets or self._weights is None:
            return False
        served = True
        for outcome in self.pusher.push(self._weights, self.version, targets):
            target = outcome.target.id
            self.metrics.push_time.labels(target).set(outcome.seconds)
            if outcome.status == "ok":
                self.metrics.push_bytes.labels(target).inc(outcome.bytes)
                self._pushed[target] = (self.version, time.monotonic())
            else:
                self.metrics.push_failures.labels(target, outcome.status).inc()
                self._pushed[target] = (0, time.monotonic())
                served = False
                log.warning("push of version %d to %s %s: %s %s", self.version, target, outcome.status,
                            outcome.code, outcome.detail)
        return served

"""The learner's side of WeightSync: after a step, snapshot the weights generators need (every rank joins the
gather under ZeRO-3) and push them to every live generator; between steps, bring a generator that joined
late (or restarted) to the current version at once.

With `background=True` rank 0 pushes on a thread of its own while the learner collects and trains the next
step. Only the push moves: the snapshot (under ZeRO-3 a sequence of collective gathers) stays on the calling
thread, so every rank runs its collectives in the same order as a synchronous publish, and the pushed tensors
are CPU copies that the next step cannot touch. One push is in flight at a time: a newer version waits for it
(`wait`) rather than replacing it, so every version reaches the generators, and the credits of the step it
follows are freed in order: by the push's thread as it completes (`then`), while the learner trains.

Push outcomes become metrics and warnings. With `learner.relay_fanout` the publisher pushes through the
relay tree (`relay.TreePush`): to a few generators that relay the version to the others, every target
reported only once it serves the version (or its push failed): docs/weights.md.

A push a generator refuses for a permanent reason (the learner's tensors do not fit its model: shape, dtype,
names; or a wrong token) fails the learner at once with that reason: retrying cannot help. Transient failures
(unreachable, a corrupted transfer, a lost race with a newer version) are retried, and a live generator that
fails `learner.push_max_failures` pushes in a row fails the learner too."""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from contextlib import nullcontext

import grpc
import torch

from asyncrlhf.config import Config
from asyncrlhf.registry import Member, Registry
from asyncrlhf.stalls import Wait
from asyncrlhf.training import engine
from asyncrlhf.version import PolicyVersion
from asyncrlhf.weights.pusher import PushOutcome, PushStatus, PushTarget, WeightPusher
from asyncrlhf.weights.relay import TreePush
from asyncrlhf.weights.vocabulary import Reason, Route
from services.learner.metrics import LearnerMetrics

log = logging.getLogger("asyncrlhf.learner")
LATE_SYNC_PERIOD_S = 0.5
# The receiver's refusals that no retry can change.
PERMANENT = {Reason.UNAUTHENTICATED, Reason.UNKNOWN_TENSOR, Reason.SHAPE_MISMATCH, Reason.DTYPE_MISMATCH,
             Reason.TENSOR_COUNT, Reason.MISSING_TENSORS, Reason.DUPLICATE_TENSOR, Reason.BAD_OFFSET}


class PushFailed(RuntimeError):
    """A generator refused the learner's weights for good, or kept failing: the run cannot go on as it is."""


class WeightPublisher:
    def __init__(self, cfg: Config, policy, rank: int, registry: Registry | None, metrics: LearnerMetrics,
                 pusher: WeightPusher | None = None):
        """`pusher`: rank 0's (from the config unless given)."""
        self.cfg, self.policy, self.rank, self.registry, self.metrics = cfg, policy, rank, registry, metrics
        self.pusher = (pusher or WeightPusher.from_config(cfg)) if rank == 0 else None
        self.version = 0  # the step published
        self.lineage = 0  # this learner start's lineage: pushed with every version
        self._weights: dict[str, torch.Tensor] | None = None
        self._pushed: dict[str, tuple[int, float]] = {}  # generator id -> (version pushed, when)
        self._routes: dict[str, Route] = {}  # generator id -> the route its last version came by
        self._last_sync = 0.0
        self._failures: dict[str, int] = {}  # generator id -> failed pushes in a row
        self._failing_since: dict[str, float] = {}  # generator id -> time.monotonic() of the first of them
        self._in_flight: threading.Thread | None = None  # the background push
        self._listed_at = 0.0  # time.monotonic() of the last registry read (`_live`)
        self._failure: BaseException | None = None  # how the background push ended, if it raised

    def publish(self, version: int, background: bool = False,
                then: Callable[[], None] = lambda: None) -> float:
        """Snapshot the weights of `version` (all ranks) and push them to every live generator (rank 0): here,
        or on a thread of its own when `background`, which calls `then` when the push completes (not when it
        failed: `wait` raises that). Returns the seconds the caller waited on pushes (the previous one still
        in flight; all of this one unless `background`)."""
        waited = self.wait()
        lc = self.cfg.learner
        started = time.perf_counter()
        self._weights = engine.full_state_dict(self.policy.module, lc.deepspeed.zero_stage, lc.lora.enabled)
        self.version = version
        if self.rank != 0:
            return waited
        if background:
            self._in_flight = threading.Thread(target=self._push_in_background, args=(started, then),
                                               name=f"publish-{version}", daemon=True)
            self._in_flight.start()
            return waited
        pushing = time.perf_counter()
        self._push_live(started)
        return waited + time.perf_counter() - pushing

    def pushed(self) -> bool:
        """Whether no push is in flight. A background push that failed raises its failure here (`PushFailed`),
        on the caller's thread."""
        if self._in_flight is not None and self._in_flight.is_alive():
            return False
        self._in_flight = None
        failure, self._failure = self._failure, None
        if failure is not None:
            raise failure
        return True

    def wait(self) -> float:
        """Wait for the push in flight, if any; the seconds waited. Raises its failure."""
        started = time.perf_counter()
        if self._in_flight is not None:
            with self.metrics.waiting.waiting(Wait.PUSH, f"the background push of version {self.version}"):
                self._in_flight.join()
        self.pushed()
        return time.perf_counter() - started

    def _push_live(self, started: float, waited_on: bool = True) -> None:
        """Push the snapshot to every live generator; `started`: when the version was ready to publish;
        `waited_on`: the learner waits for it (not a background push: the learner works meanwhile)."""
        if self._push([PushTarget(m.id, m.address) for m in self._live()], waited_on):
            self.metrics.step_to_serve.set(time.perf_counter() - started)
        self.metrics.publish_time.observe(time.perf_counter() - started)

    def _push_in_background(self, started: float, then: Callable[[], None]) -> None:
        try:
            self._push_live(started, waited_on=False)
            then()
        except BaseException as err:  # handed to the learner's thread by `pushed`
            self._failure = err

    @property
    def current(self) -> PolicyVersion:
        return PolicyVersion(self.lineage, self.version)

    def sync_late_generators(self) -> None:
        """Push the current version to live generators behind it, retrying a failed one after two beats (not
        while a background push is in flight: it reaches every live generator)."""
        now = time.monotonic()
        if now - self._last_sync < LATE_SYNC_PERIOD_S or not self.pushed():
            return
        self._last_sync = now
        retry_after = 2 * self.cfg.generator.heartbeat_s
        behind = [
            PushTarget(m.id, m.address) for m in self._live()
            if self.current.newer_than(m.version)
            and (self._pushed.get(m.id, (0, 0.0))[0] < self.version
                 or now - self._pushed[m.id][1] > retry_after)
        ]
        if behind:
            self._push(behind)

    def close(self) -> None:
        if self._in_flight is not None:  # its failure, if any, was the learner's to raise (`wait`)
            self._in_flight.join()
        if self.pusher is not None:
            self.pusher.close()

    def _live(self) -> list[Member]:
        """The live generators; only rank 0 holds the registry. Notes when it was read (`_failed`)."""
        self._listed_at = time.monotonic()
        return self.registry.live() if self.registry is not None else []

    def _push(self, targets: list[PushTarget], waited_on: bool = True) -> bool:
        """Push the current version to `targets`; whether every one of them serves it now. `waited_on`: the
        learner's thread waits for it, so its wait state says so."""
        if not targets or self._weights is None or self.pusher is None:  # only rank 0 pushes
            return False
        served = True
        push = self.pusher.prepare(self._weights, self.current)
        fanout = self.cfg.learner.relay_fanout  # the tree, else directly to each
        marked = self.metrics.waiting.waiting(Wait.PUSH, ", ".join(t.id for t in targets)) if waited_on \
            else nullcontext()
        with marked:
            outcomes = TreePush(self.pusher, push, fanout).run(targets) if fanout else \
                self.pusher.send(push, targets)
        for outcome in outcomes:
            target = outcome.target.id
            self.metrics.push_time.labels(target).set(outcome.seconds)
            if outcome.status == PushStatus.OK:
                self.metrics.push_bytes.labels(target).inc(outcome.bytes)
                if outcome.route is not None:  # always, when ok
                    self.metrics.pushes.labels(outcome.route.value).inc()
                    if self._routes.get(target) != outcome.route:
                        self._routes[target] = outcome.route
                        log.info("versions reach %s over the %s route from version %d", target,
                                 outcome.route.value, self.version)
                if not outcome.relayed_by:  # the learner's own upload
                    self.metrics.pushed_versions.labels(outcome.encoding.value).inc()
                    self.metrics.pushed_bytes.labels(outcome.encoding.value).inc(outcome.bytes)
                self._pushed[target] = (self.version, time.monotonic())
                self._failures.pop(target, None)
                self._failing_since.pop(target, None)
            else:
                self.metrics.push_failures.labels(target, outcome.status.value).inc()
                self._pushed[target] = (0, time.monotonic())
                served = False
                self._failed(outcome)
        return served

    def _failed(self, outcome: PushOutcome) -> None:
        target = outcome.target
        what = (f"push of version {self.version} to generator {target.id} ({target.address}) "
                f"{outcome.status}: {outcome.code.name} {outcome.detail}")
        permanent = outcome.reason in PERMANENT or outcome.code == grpc.StatusCode.UNAUTHENTICATED
        if outcome.status == PushStatus.REJECTED and permanent:
            raise PushFailed(f"{what}. The generator cannot take these weights: check that it serves the "
                             "same model (and LoRA settings) as the learner and the same run.token.")
        failures = self._failures[target.id] = self._failures.get(target.id, 0) + 1
        first = self._failing_since.setdefault(target.id, time.monotonic())
        limit, ttl = self.cfg.learner.push_max_failures, self.cfg.generator.registry_ttl_s
        # A generator that died leaves the registry within its TTL: one still listed after failing that long
        # keeps heart-beating, yet cannot be reached. Only that fails the learner; a dead one is waited out.
        # Listed: by the registry read this push's targets came from, not the moment the push failed (a
        # dead generator read just before its entry expired fails its push just after).
        if failures >= limit and self._listed_at - first >= ttl:
            raise PushFailed(f"{what}; {failures} failed pushes in a row over {ttl:g} s to a generator that "
                             f"stays registered (learner.push_max_failures={limit}, "
                             "generator.registry_ttl_s): check its log and network.")
        log.warning("%s (failure %d of at most %d in a row; retrying)", what, failures, limit)

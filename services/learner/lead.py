"""Rank 0's duties beside training: it leads the other ranks and does every bit of the learner's I/O.

It collects each step (`asyncrlhf.inbox.Inbox`: read, admit, judge staleness), records what a step trained
(the consumed log, metrics, trackers), pushes the new version to the generators and releases the step's
credits (at once after a synchronous push, on the push's thread after a background one), emits the run's
events, fills in a checkpoint's inbox records, watches for stalls and serves the learner's HTTP. The other
ranks' duties are `services/learner/follower.py`'s; the loop that drives both is `services/learner/loop.py`.
"""

from __future__ import annotations

import logging
import threading
import time
import uuid
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

from asyncrlhf._proto.events_pb2 import (
    EVENT_KIND_CHECKPOINT_SAVED,
    EVENT_KIND_GROUPS_TRAINED,
    EVENT_KIND_POLICY_VERSION,
    EVENT_KIND_RUN_FINISHED,
    Event,
    EventKind,
)
from asyncrlhf.inbox.inbox import Inbox
from asyncrlhf.inbox.strategy import StepBatch
from asyncrlhf.learner import LearnerParts
from asyncrlhf.metrics import make_app, write_final_metrics
from asyncrlhf.registry import Registry
from asyncrlhf.service import HttpServer, check_bind
from asyncrlhf.stalls import Wait
from asyncrlhf.streams import EVENTS, RunStreams, connect
from asyncrlhf.trackers import open_trackers, step_scalars
from asyncrlhf.training import engine
from asyncrlhf.training.batch import TrainGroup
from asyncrlhf.training.checkpoint import LearnerState
from services.learner.metrics import LearnerMetrics, step_summary
from services.learner.stalls import StallWatch
from services.learner.sync import WeightPublisher

log = logging.getLogger("asyncrlhf.learner")


class Lead:
    def __init__(self, parts: LearnerParts, state: LearnerState, metrics: LearnerMetrics, resumed: bool,
                 stop: threading.Event):
        cfg = self.cfg = parts.cfg
        self.state, self.metrics, self.stop = state, metrics, stop
        self.objective, self.trainer = parts.objective, parts.trainer
        log.info("deepspeed in effect: %s", engine.effective_settings(parts.models.policy, cfg.learner))
        self.client = connect(cfg.redis)
        streams = RunStreams(self.client, cfg.run.name, cfg.redis)
        self.events = streams.producer(EVENTS)
        registry = Registry(self.client, cfg.run.name, ttl_s=cfg.generator.registry_ttl_s)
        # A new lineage begins here, before anything is pushed (see asyncrlhf.consumed).
        self.inbox = Inbox(cfg, streams, parts.prompts, state, metrics, resumed=resumed)
        self.trackers = open_trackers(cfg, "learner")
        self.watch = StallWatch(cfg, metrics)
        self.http = self._serve_http()
        self.weights = WeightPublisher(cfg, parts.models.policy, parts.rank, registry, metrics)
        self.weights.lineage = state.lineage
        self.background = cfg.learner.background_publish and cfg.learner.staleness_mode == "bound"
        if cfg.learner.background_publish and not self.background:
            log.info("learner.staleness_mode=%s: weights are published synchronously (a window closes at a "
                     "push, so the step waits for it)", cfg.learner.staleness_mode)
        self._waited = {"data": 0.0, "push": 0.0}  # this step's waits, seconds
        self._step_ended = time.perf_counter()

    def _serve_http(self) -> HttpServer:
        check_bind(self.cfg.learner.http_host, self.cfg, "learner HTTP")
        app = make_app("learner", self.metrics.registry, ready=self._ready)
        http = HttpServer(app, self.cfg.learner.http_host, self.cfg.learner.http_port).start()
        log.info("learner HTTP on %s", http.url)
        return http

    def _ready(self) -> tuple[bool, str]:
        self.client.ping()
        return True, f"version {self.state.version}"

    def start(self) -> None:
        self.watch.start()

    # -- a step: collect, (train), trained, (checkpoint), ended -------------------------------------------

    def collect(self) -> StepBatch | None:
        """The next step's groups (None: the run ends), from the inbox."""
        with self._waiting_for_data():
            return self.inbox.collect(self.state.version, self.stop, self.weights.sync_late_generators)

    def trained(self, batch: StepBatch | None, groups: list[TrainGroup], stats: dict, started: float,
                publish: bool) -> None:
        """After the step that made `self.state.version`: record it, publish the version (unless
        `learner.sync_every` skips it) and release the step's credits, emit its event. `started`: when the
        step began (perf_counter)."""
        self.watch.stepped()
        assert batch is not None, "rank 0 trains only a batch it collected"
        waited = self.await_push()
        self.inbox.trained(batch, self.state.version)
        step_s = time.perf_counter() - started - waited  # the step's own time, as its histogram says
        self.metrics.step_time.observe(step_s)
        self.metrics.record_step(stats, groups, self.state.version)
        self.metrics.record_batching(stats, batch.filtered, batch.capped)
        lr = self.trainer.policy.get_lr()[0] if hasattr(self.trainer.policy, "get_lr") else None
        self.trackers.log_scalars(step_scalars(stats, [g.decision.staleness for g in groups], step_s, lr),
                                  step=self.state.version - 1)
        self._publish(batch, publish)
        self._emit(EVENT_KIND_GROUPS_TRAINED, group_ids=[g.message.group_id for g in groups], values=stats)

    def step_ended(self, stats: dict) -> None:
        """After the step's checkpoint (if any): its waits into the metrics, and its log line."""
        now = time.perf_counter()
        self.metrics.record_waits(now - self._step_ended, self._waited["data"], self._waited["push"])
        self._step_ended, self._waited = now, {"data": 0.0, "push": 0.0}
        log.info("step %d version %d %s reward %.3f", self.state.steps, self.state.version,
                 step_summary(stats), stats["reward_mean"])

    def await_push(self) -> float:
        """Wait for the background push in flight, which releases its step's credits (before the next step's
        are held: one step's credits await a push at a time); the seconds waited."""
        waited = self.weights.wait()
        self._waited_on_push(waited)
        return waited

    def _publish(self, batch: StepBatch, publish: bool) -> None:
        """Push the new version and release the step's credits: at once after a synchronous push, before
        events and checkpoints (no generator waits); on the push's thread as it completes after a background
        one. Without a push, the credits are released at once."""
        version = self.state.version
        if not publish:
            self.inbox.release(version)
            return
        with self._waiting_for_data():
            self.inbox.settle(batch, version - 1, self.stop, self.weights.sync_late_generators)
        if self.background:
            self._waited_on_push(self.weights.publish(version, background=True,
                                                      then=self.inbox.release_after_push(version)))
        else:
            self._waited_on_push(self.weights.publish(version))
            self.inbox.release(version)

    @contextmanager
    def _waiting_for_data(self) -> Iterator[None]:
        """The block waits for scored groups: the wait state says so, and the step's data wait counts it."""
        started = time.perf_counter()
        try:
            with self.metrics.waiting.waiting(Wait.SCORED_GROUPS):
                yield
        finally:
            self._waited["data"] += time.perf_counter() - started

    def _waited_on_push(self, seconds: float) -> None:
        self._waited["push"] += seconds
        self.metrics.push_wait.inc(seconds)

    # -- checkpoints, events, the end ----------------------------------------------------------------------

    def checkpointing(self) -> None:
        """Before a checkpoint is saved: the inbox's records and the KL coefficient go into the learner's
        state, from the learner's own records (a checkpoint needs no Redis: it may be down)."""
        self.state.cursor, self.state.finished = self.inbox.known_cursor, self.inbox.known_finished
        controller = getattr(self.objective, "kl_controller", None)
        self.state.kl_coef = controller.value if controller else None

    def checkpointed(self, path: Path) -> None:
        self._emit(EVENT_KIND_CHECKPOINT_SAVED, checkpoint_path=str(path.resolve()))
        log.info("checkpoint %s", path)

    def finish(self) -> None:
        """After the last checkpoint: the last event (the evaluator stops on RUN_FINISHED), held by the
        replicas, then everything closed."""
        self.watch.stop()
        done = self.state.steps >= self.cfg.learner.total_steps
        self._emit(EVENT_KIND_RUN_FINISHED if done else EVENT_KIND_POLICY_VERSION)
        self.inbox.replica_wait("the learner's last event")
        self.weights.close()
        self.trackers.close()
        write_final_metrics(self.metrics.registry, self.cfg.run.path, "learner")
        self.http.stop()

    def _emit(self, kind: EventKind, **fields) -> None:
        values = {k: float(v) for k, v in fields.pop("values", {}).items()}
        self.events.add(Event(event_id=uuid.uuid4().hex, kind=kind, policy_version=self.state.version,
                              timestamp=time.time(), source="learner", values=values, **fields))

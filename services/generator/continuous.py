"""The continuous generation loop (`generator.mode: continuous`): the engine stays full, groups enter when
k slots are free and leave the step their last sample ends, pushes land between two engine steps. One loop for
single-turn samples and episodes: what a group's samples are is the `GroupKind`'s (an episode in flight waits
in the engine or on its environment; either way it holds a slot of `max_running_samples`).

    run the pushes queued for the engine -> read groups while slots are free (their saved or handed-on
    progress continued; one sampled by a newer version than this generator serves waits for it) -> one
    engine step (episodes: environment steps that returned put their next turns in first) -> XADD each
    ended RolloutGroup and XACK its prompt atomically -> save progress every `save_every_tokens` -> on stop:
    every unfinished group back to the prompts stream with its progress (the last two: `handover`)

This thread is the only one that talks to the engine (`asyncrlhf.sampling.vllm_stepping`): a push's swap is
queued to it by the gRPC thread and runs between two engine steps, so the version read before a step is the
one whose weights run it. The sampling bookkeeping is `asyncrlhf.sampling.continuous`, the groups waiting for
a version `asyncrlhf.sampling.version_wait`; this shell does the Redis I/O.
"""

from __future__ import annotations

import logging
import threading
import time
from typing import Any

from asyncrlhf._proto.rollout_pb2 import FinishReason, PromptGroup
from asyncrlhf.sampling.continuous import ContinuousSampler, GroupPrompt, GroupRun, StepEngine
from asyncrlhf.sampling.rollouts import carried
from asyncrlhf.sampling.version_wait import VersionWait, waits_for
from asyncrlhf.stalls import Wait
from asyncrlhf.streams import Delivery
from asyncrlhf.streams.consumer import Keeper
from asyncrlhf.version import PolicyVersion
from services.generator.handover import Handover
from services.generator.loop import GroupKind, LoopContext, Work, model_tokens

log = logging.getLogger(__name__)

IDLE_READ_MS = 100  # an empty engine waits this long for prompts: the API's requests wait at most as long
SETTLE_S = 0.05  # with no sequence in the engine, how long a step waits for an environment call to return

Run = GroupRun[Delivery[PromptGroup], Any]


class ContinuousLoop:
    def __init__(self, ctx: LoopContext, kind: GroupKind, engine: StepEngine):
        g = ctx.cfg.generator
        self.ctx, self.kind, self.engine = ctx, kind, engine
        self.metrics, self.consumer = ctx.metrics, ctx.io.consumer
        self.sampler: ContinuousSampler[Delivery[PromptGroup], Any] = ContinuousSampler(
            engine, kind.continuous(), g.sampling)
        self.capacity = g.max_running_samples or g.batch_prompts * g.samples_per_prompt
        self.keeper = Keeper(self.consumer, ctx.cfg.redis.claim_idle_ms)
        self.handover = Handover(ctx, self.sampler)
        self.waiting: VersionWait[Work] = VersionWait()
        self._written_tokens = 0

    def run(self, stop: threading.Event) -> None:
        """Step until `stop` is set, then hand every unfinished group on."""
        try:
            while not stop.is_set():
                self.step()
        finally:
            self._stop()

    def _stop(self) -> None:
        try:
            handed = self.hand_on()
            self.engine.fail_waiting("the generator is stopping")
            # what `asyncrlhf bench chaos` adds up to count the tokens sampled twice (the last scrape before
            # a stop can miss a step's tokens; this line cannot)
            log.info("generator stopped: %d tokens sampled, %d written in groups, %d groups handed on",
                     int(self.sampler.sampled_tokens), int(self._written_tokens), handed)
        finally:
            self.sampler.close()  # environment steps still running are left unread

    def close(self) -> None:
        self.kind.close()

    def step(self) -> int:
        """Fill free slots, take one engine step, write the groups that ended; returns groups written."""
        self.sampler.settle(SETTLE_S)  # bounded: a push queued meanwhile waits at most SETTLE_S
        written = self._step()
        for run, reason in self.sampler.take_failed():  # retried after claim_idle_ms, as in batch mode
            log.error("group %s failed: %s", run.group_id, reason)
            self.consumer.fail(run.tag, reason)
            self.metrics.failed_groups.inc()
        return written

    def _step(self) -> int:
        self.ctx.update_pending()
        self.engine.serve_calls()  # a push lands here, between two engine steps
        if self.ctx.no_weights_yet(self.engine.serve_calls):  # the first push comes as a call for this thread
            return 0
        start = time.monotonic()
        self._fill()
        running = self.sampler.running_samples
        if not running and not self._others_waiting():
            self.metrics.waiting.wait(Wait.PROMPTS)
            self.metrics.idle_seconds.inc(time.monotonic() - start)
            self.metrics.occupancy.set(0.0)
            self._keep_held()  # groups waiting for a version
            return self._emit(self.sampler.finished_now())
        self.metrics.waiting.work()
        before = self.sampler.sampled_tokens
        step_start = time.perf_counter()
        with self.ctx.busy():
            served = self.ctx.swap.served  # changes on this thread only (serve_calls): its weights run it
            self._restart_other_lineages(served)
            ended = self.sampler.step(served.step)
        seconds = time.perf_counter() - step_start
        tokens = self.sampler.sampled_tokens - before
        self.metrics.tokens.inc(tokens)
        self.metrics.occupancy.set(min(1.0, running / self.capacity))
        if seconds > 0:
            self.metrics.tokens_per_second.set(tokens / seconds)
        written = self._emit(ended)
        self.handover.save_due()
        self._keep_held()
        return written

    def _others_waiting(self) -> bool:
        return self.engine.pending() or self.engine.running() > 0

    # -- groups in -----------------------------------------------------------------------------------------

    def _fill(self) -> None:
        k = self.ctx.cfg.generator.samples_per_prompt
        served = self.ctx.swap.served
        for w in self.waiting.ready(served):  # this generator now serves the version they waited for
            self._start(w.item, w.prompt, served.lineage)
        free = self.capacity - self.sampler.running_samples
        if free < k:
            return
        busy = self.sampler.running_samples > 0 or self._others_waiting()
        deliveries = self.consumer.read(max(1, free // k), block_ms=0 if busy else IDLE_READ_MS)
        # a group re-claimed while it ran long (or waited) here stays ours
        mine = {run.group_id for run in self.sampler.groups}
        work = [w for w in self.ctx.admit(deliveries)
                if (gid := w.delivery.message.group_id) not in mine and gid not in self.waiting]
        messages = [w.delivery.message for w in work]
        partials = self.ctx.io.partials
        prompts = partials.further(messages) if partials else messages
        for item, prompt in zip(work, prompts, strict=True):
            version = waits_for(prompt, served)
            if version is None:
                self._start(item, prompt, served.lineage)
            else:
                self._wait(item, prompt, version, served)

    def _wait(self, item: Work, prompt: PromptGroup, version: int, served: PolicyVersion) -> None:
        """Keep a group whose partial samples a newer version sampled until this generator serves it."""
        gid = item.delivery.message.group_id
        log.info("group %s was sampled up to version %d and this generator serves %d: it waits here for "
                 "version %d (token versions never go down along a sample)", gid, version, served.step,
                 version)
        self.metrics.version_waits.inc()
        self.waiting.add(gid, item, prompt, version)

    def _start(self, work: Work, prompt: PromptGroup, lineage: int) -> None:
        """Start a group read from the stream (`prompt`: its message, or its saved progress if further)."""
        message = work.delivery.message
        partial = carried(prompt, lineage)
        unfinished = FinishReason.FINISH_REASON_UNSPECIFIED
        continued = sum(1 for p in partial if p.completion_token_ids and p.finish_reason == unfinished)
        if continued:
            self.metrics.continued_samples.inc(continued)
            log.info("continuing group %s: %d %s from %d tokens sampled elsewhere", message.group_id,
                     continued, self.kind.noun, sum(len(p.completion_token_ids) for p in partial))
        self.sampler.start(work.delivery, message.group_id,
                           GroupPrompt(work.ids, message.prompt, message.reference or None), work.k,
                           lineage=lineage, partial=partial)

    def _restart_other_lineages(self, served: PolicyVersion) -> None:
        """Weights of another learner lineage arrived: samples begun under the old one start again."""
        stale = [run.group_id for run in self.sampler.groups if run.lineage != served.lineage]
        if stale:
            log.warning("lineage %d's weights arrived: %d groups in flight start again", served.lineage,
                        len(stale))
            self.sampler.restart(stale, served.lineage)

    # -- groups out ----------------------------------------------------------------------------------------

    def _emit(self, runs: list[Run]) -> int:
        if not runs:
            return 0
        self.kind.observe(runs)
        now, version = time.time(), self.ctx.backend.version
        groups = [self.sampler.kind.rollout(run.tag.message, run, PolicyVersion(run.lineage, version),
                                            self.ctx.generator_id, now, self.ctx.decode) for run in runs]
        self.consumer.ack([run.tag for run in runs], groups, to=self.ctx.io.producer)
        self.handover.forget(runs)
        written = model_tokens(groups)
        self._written_tokens += written
        self.metrics.written_tokens.inc(written)
        self.metrics.groups.inc(len(groups))
        for run in runs:
            self.metrics.batch_seconds.observe(now - run.started_at)
        return len(groups)

    def _keep_held(self) -> None:
        """Keep every group in flight, and every group waiting for a version, from being re-claimed as
        stalled."""
        waiting = [w.item.delivery for w in self.waiting.items()]
        self.keeper.keep([run.tag for run in self.sampler.groups] + waiting)

    def hand_on(self) -> int:
        """Stop sampling and put every unfinished group back on the prompts stream with its progress, for
        another generator to continue. Returns groups handed on."""
        return self.handover.hand_on(self.sampler.stop_all(), self.waiting.take_all())

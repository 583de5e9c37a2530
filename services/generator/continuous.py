"""The continuous generation loop (`generator.mode: continuous`): the engine stays full, groups enter when
k slots are free and leave the step their last sample ends, pushes land between two engine steps.

    run the pushes queued for the engine -> read groups while slots are free (their saved or handed-on
    progress continued; one sampled by a newer version than this generator serves waits for it) -> one
    engine step -> XADD each ended RolloutGroup and XACK its prompt atomically -> save progress every
    `save_every_tokens` -> on stop: every unfinished group back to the prompts stream with its progress

This thread is the only one that talks to the engine (`asyncrlhf.sampling.vllm_stepping`): a push's swap is
queued to it by the gRPC thread and runs between two engine steps, so the version read before a step is the
one whose weights run it. The sampling bookkeeping is `asyncrlhf.sampling.continuous`, the groups waiting for
a version `asyncrlhf.sampling.version_wait`; this shell does the Redis I/O.
"""

from __future__ import annotations

import logging
import threading
import time
from contextlib import nullcontext

from asyncrlhf._proto.rollout_pb2 import PromptGroup, RolloutGroup
from asyncrlhf.config import Config
from asyncrlhf.cores import CoreShare
from asyncrlhf.sampling.continuous import ContinuousSampler, GroupRun, StepEngine
from asyncrlhf.sampling.rollouts import handed_on, progress_of, rollout_group
from asyncrlhf.sampling.version_wait import VersionWait, waits_for
from asyncrlhf.stalls import Wait
from asyncrlhf.streams import Delivery
from asyncrlhf.streams.consumer import hold
from asyncrlhf.version import PolicyVersion
from services.generator.loop import GeneratorLoop, PromptIO, Work
from services.generator.server import WeightSwap

log = logging.getLogger(__name__)

IDLE_READ_MS = 100  # an empty engine waits this long for prompts: the API's requests wait at most as long

Run = GroupRun[Delivery[PromptGroup]]


class ContinuousLoop(GeneratorLoop):
    def __init__(self, cfg: Config, swap: WeightSwap, io: PromptIO, tokenizer, generator_id: str,
                 engine: StepEngine, cores: CoreShare | None = None):
        super().__init__(cfg, swap, io, tokenizer, generator_id, cores)
        g = cfg.generator
        self.engine = engine
        self.sampler: ContinuousSampler[Delivery[PromptGroup]] = ContinuousSampler(engine, g.sampling)
        self.capacity = g.max_running_samples or g.batch_prompts * g.samples_per_prompt
        self.handon, self.partials = io.handon, io.partials
        self._next_hold = 0.0
        self._hold_every_s = cfg.redis.claim_idle_ms / 3000
        self._written_tokens = 0
        self.waiting: VersionWait[Work] = VersionWait()

    def run(self, stop: threading.Event) -> None:
        """Step until `stop` is set, then hand every unfinished group on."""
        try:
            while not stop.is_set():
                self.step()
        finally:
            handed = self.hand_on()
            self.engine.fail_waiting("the generator is stopping")
            # what `asyncrlhf bench chaos` adds up to count the tokens sampled twice (the last scrape before
            # a stop can miss a step's tokens; this line cannot)
            log.info("generator stopped: %d tokens sampled, %d written in groups, %d groups handed on",
                     int(self.sampler.sampled_tokens), int(self._written_tokens), handed)

    def step(self) -> int:
        """Fill free slots, take one engine step, write the groups that ended; returns groups written."""
        self._update_pending()
        self.engine.serve_calls()  # a push lands here, between two engine steps
        if self._no_weights_yet():
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
        with self.cores.busy() if self.cores else nullcontext():
            served = self.swap.served  # changes on this thread only (serve_calls): its weights run this step
            self._restart_other_lineages(served)
            ended = self.sampler.step(served.step)
        seconds = time.perf_counter() - step_start
        tokens = self.sampler.sampled_tokens - before
        self.metrics.tokens.inc(tokens)
        self.metrics.occupancy.set(min(1.0, running / self.capacity))
        if seconds > 0:
            self.metrics.tokens_per_second.set(tokens / seconds)
        written = self._emit(ended + self.sampler.finished_now())
        self._save_due()
        self._keep_held()
        return written

    def _await_weights(self, timeout_s: float) -> None:
        self.engine.serve_calls(timeout_s)  # the first push comes as a call for this thread

    def _others_waiting(self) -> bool:
        return self.engine.pending() or self.engine.running() > 0

    # -- groups in -----------------------------------------------------------------------------------------

    def _fill(self) -> None:
        k = self.cfg.generator.samples_per_prompt
        served = self.swap.served
        for w in self.waiting.ready(served):  # this generator now serves the version they waited for
            self._start(*w.item, w.prompt, served.lineage)
        free = self.capacity - self.sampler.running_samples
        if free < k:
            return
        busy = self.sampler.running_samples > 0 or self._others_waiting()
        deliveries = self.consumer.read(max(1, free // k), block_ms=0 if busy else IDLE_READ_MS)
        # a group re-claimed while it ran long (or waited) here stays ours
        mine = {run.group_id for run in self.sampler.groups}
        work = [w for w in self._admit(deliveries)
                if w[0].message.group_id not in mine and w[0].message.group_id not in self.waiting]
        messages = [d.message for d, _, _ in work]
        prompts = self.partials.further(messages) if self.partials else messages
        for item, prompt in zip(work, prompts, strict=True):
            version = waits_for(prompt, served)
            if version is None:
                self._start(*item, prompt, served.lineage)
            else:
                self._wait(item, prompt, version, served)

    def _wait(self, item: Work, prompt: PromptGroup, version: int, served: PolicyVersion) -> None:
        """Keep a group whose partial samples a newer version sampled until this generator serves it."""
        gid = item[0].message.group_id
        log.info("group %s was sampled up to version %d and this generator serves %d: it waits here for "
                 "version %d (token versions never go down along a sample)", gid, version, served.step,
                 version)
        self.metrics.version_waits.inc()
        self.waiting.add(gid, item, prompt, version)

    def _start(self, d: Delivery[PromptGroup], ids: list[int], k: int, prompt: PromptGroup,
               lineage: int) -> None:
        """Start a group read from the stream (`prompt`: its message, or its saved progress if further)."""
        partial = progress_of(prompt, lineage)
        continued = sum(1 for p in partial if p.finish is None and p.token_ids)
        if continued:
            self.metrics.continued_samples.inc(continued)
            log.info("continuing group %s: %d samples from %d tokens sampled elsewhere",
                     d.message.group_id, continued, sum(len(p.token_ids) for p in partial))
        self.sampler.start(d, d.message.group_id, ids, k, lineage=lineage, partial=partial)

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
        now = time.time()
        groups = [self._rollout(run, now) for run in runs]
        self.consumer.ack([run.tag for run in runs], groups, to=self.producer)
        if self.partials:
            self.partials.forget([run.group_id for run in runs])
        # the model's tokens (an episode's environment tokens, loss mask 0, are not sampled)
        written = sum(sum(s.loss_mask) if s.loss_mask else len(s.completion_token_ids)
                      for g in groups for s in g.samples)
        self._written_tokens += written
        self.metrics.written_tokens.inc(written)
        self.metrics.groups.inc(len(groups))
        for run in runs:
            self.metrics.batch_seconds.observe(now - run.started_at)
        return len(groups)

    def _rollout(self, run: Run, now: float) -> RolloutGroup:
        return rollout_group(run.tag.message, [s.completion() for s in run.samples],
                             PolicyVersion(run.lineage, self.backend.version), self.generator_id,
                             run.started_at, now, self._decode)

    def _save_due(self) -> None:
        """Save the groups grown by `save_every_tokens` on any sample since their last save."""
        every = self.cfg.generator.save_every_tokens
        due = [run for run in self.sampler.groups
               if max((len(s.token_ids) for s in run.samples), default=0) >= every
               and run.tokens - run.saved_tokens >= every]
        if due and self.partials:
            self.partials.save([self._progress(run) for run in due])
            for run in due:
                run.saved_tokens = run.tokens

    def _keep_held(self) -> None:
        """Keep every group in flight, and every group waiting for a version, from being re-claimed as
        stalled."""
        now = time.monotonic()
        held = [run.tag for run in self.sampler.groups] + [w.item[0] for w in self.waiting.items()]
        if held and now >= self._next_hold:
            self._next_hold = now + self._hold_every_s
            hold(self.consumer, held)

    def hand_on(self) -> int:
        """Stop sampling and put every unfinished group back on the prompts stream with its progress (one
        atomic ack-and-add per group set), for another generator to continue. Returns groups handed on."""
        runs, waiting = self.sampler.stop_all(), self.waiting.take_all()
        if not runs and not waiting:
            return 0
        if self.handon is None:  # nowhere to hand them: they stay pending, re-claimed after claim_idle_ms
            return 0
        again = [self._progress(run) for run in runs]
        for prompt in again:
            prompt.handoffs += 1
        tags = [run.tag for run in runs] + [w.item[0] for w in waiting]
        self.consumer.ack(tags, again + [w.prompt for w in waiting], to=self.handon)  # waiting: as they came
        if self.partials:
            self.partials.forget([run.group_id for run in runs])
        tokens = sum(run.tokens for run in runs)
        log.info("handed on %d groups with %d tokens sampled (and %d waiting for a version, as they came)",
                 len(runs), tokens, len(waiting))
        self.metrics.handed_on_samples.inc(sum(len(run.samples) for run in runs))
        return len(runs) + len(waiting)

    def _progress(self, run: Run) -> PromptGroup:
        return handed_on(run.tag.message, run.samples, run.lineage, self._decode)

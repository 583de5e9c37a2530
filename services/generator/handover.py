"""Continuous mode's progress that outlives this generator: every group in flight saved each time it grows by
`save_every_tokens` (a SIGKILL loses at most the tokens since), and at a stop every unfinished group put back
on the prompts stream with its progress (a SIGTERM loses nothing), for another generator to continue from
where it stopped (`asyncrlhf.streams.partials`, `PromptGroup.partial_samples`)."""

from __future__ import annotations

import logging
from typing import Any

from asyncrlhf._proto.rollout_pb2 import PromptGroup
from asyncrlhf.sampling.continuous import ContinuousSampler, GroupRun
from asyncrlhf.sampling.rollouts import handed_on
from asyncrlhf.sampling.version_wait import Waiting
from asyncrlhf.streams import Delivery
from services.generator.loop import LoopContext, Work

log = logging.getLogger(__name__)

Run = GroupRun[Delivery[PromptGroup], Any]


class Handover:
    """The saves and the hand-on of the groups of `sampler` (their progress: `SampleKind.partial`)."""

    def __init__(self, ctx: LoopContext, sampler: ContinuousSampler[Delivery[PromptGroup], Any]):
        self.ctx, self.sampler = ctx, sampler

    def save_due(self) -> None:
        """Save the groups grown by `save_every_tokens` on any sample since their last save."""
        every, partials = self.ctx.cfg.generator.save_every_tokens, self.ctx.io.partials
        due = [run for run in self.sampler.groups
               if max((len(s.token_ids) for s in run.samples), default=0) >= every
               and run.tokens - run.saved_tokens >= every]
        if due and partials:
            partials.save([self.progress(run) for run in due])
            for run in due:
                run.saved_tokens = run.tokens

    def forget(self, runs: list[Run]) -> None:
        """The saves of groups written or handed on: no longer needed."""
        if self.ctx.io.partials:
            self.ctx.io.partials.forget([run.group_id for run in runs])

    def hand_on(self, runs: list[Run], waiting: list[Waiting[Work]]) -> int:
        """Put `runs` (stopped) back on the prompts stream with their progress, and the groups `waiting` for a
        version as they came (one atomic ack-and-add), for another generator to continue. Returns groups
        handed on."""
        handon = self.ctx.io.handon
        if (not runs and not waiting) or handon is None:  # else they stay pending, re-claimed later
            return 0
        again = [self.progress(run) for run in runs]
        for prompt in again:
            prompt.handoffs += 1
        tags = [run.tag for run in runs] + [w.item.delivery for w in waiting]
        self.ctx.io.consumer.ack(tags, again + [w.prompt for w in waiting], to=handon)
        self.forget(runs)
        log.info("handed on %d groups with %d tokens sampled (and %d waiting for a version, as they came)",
                 len(runs), sum(run.tokens for run in runs), len(waiting))
        self.ctx.metrics.handed_on_samples.inc(sum(len(run.samples) for run in runs))
        return len(runs) + len(waiting)

    def progress(self, run: Run) -> PromptGroup:
        """The group with its samples' progress (an episode: its transcript), for another generator."""
        partials = [self.sampler.kind.partial(s, self.ctx.decode) for s in run.samples]
        return handed_on(run.tag.message, partials, run.lineage)

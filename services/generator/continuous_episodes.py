"""Episodes in the continuous loop (`generator.mode: continuous` with `task.env`): the continuous loop's Redis
I/O, engine thread, saves and hand-on, over `asyncrlhf.envs.continuous.ContinuousEpisodes` instead of
single-turn samples.

    read groups while slots are free (handed-on or saved episodes replayed) -> environment calls that
    returned put their episodes' next turns into the engine -> one engine step -> XADD each
    group whose k episodes ended and XACK its prompt atomically -> save progress every `save_every_tokens`
    -> on stop: every unfinished group back to the prompts stream with its episodes' transcripts

A slot is an episode in flight, in the engine or waiting on its environment (`max_running_samples`).
"""

from __future__ import annotations

import logging
import threading

from asyncrlhf._proto.rollout_pb2 import FinishReason, PromptGroup, RolloutGroup
from asyncrlhf.config import Config
from asyncrlhf.cores import CoreShare
from asyncrlhf.envs.continuous import ContinuousEpisodes, EpisodeRun
from asyncrlhf.envs.episode import EpisodeRunner, episode_limits
from asyncrlhf.envs.loading import EnvFactory
from asyncrlhf.envs.rollouts import episode_group
from asyncrlhf.sampling.continuous import StepEngine
from asyncrlhf.streams import Delivery
from asyncrlhf.version import PolicyVersion
from services.generator.continuous import ContinuousLoop
from services.generator.episodes import observe_episodes
from services.generator.loop import PromptIO
from services.generator.server import WeightSwap

log = logging.getLogger(__name__)

SETTLE_S = 0.05  # with no turn in the engine, how long a step waits for an environment call to return


class ContinuousEpisodeLoop(ContinuousLoop):
    def __init__(self, cfg: Config, swap: WeightSwap, io: PromptIO, tokenizer, generator_id: str,
                 engine: StepEngine, cores: CoreShare | None = None):
        super().__init__(cfg, swap, io, tokenizer, generator_id, engine, cores)
        self.envs = EnvFactory(cfg.task.env)
        limits = episode_limits(cfg, cfg.generator.sampling.max_new_tokens)
        self.runner = EpisodeRunner(tokenizer, self.envs, limits, cfg.model.system_prompt or "")
        self.episodes: ContinuousEpisodes[Delivery[PromptGroup]] = ContinuousEpisodes(
            engine, self.runner, cfg.generator.sampling)
        self.sampler = self.episodes  # type: ignore[assignment]  # the same interface, over episodes

    def run(self, stop: threading.Event) -> None:
        try:
            super().run(stop)
        finally:
            self.episodes.close()

    def close(self) -> None:
        self.envs.close()  # an MCP server's process ends with its session

    def step(self) -> int:
        self.episodes.settle(SETTLE_S)  # bounded: a push queued meanwhile waits at most SETTLE_S
        written = super().step()
        for run, reason in self.episodes.take_failed():  # retried after claim_idle_ms, as in batch mode
            log.error("episode group %s failed: %s", run.group_id, reason)
            self.consumer.fail(run.tag, reason)
            self.metrics.failed_groups.inc()
        return written

    def _start(self, d: Delivery[PromptGroup], ids: list[int], k: int, prompt: PromptGroup,
               lineage: int) -> None:
        partial = list(prompt.partial_samples) if prompt.partial_lineage == lineage else []
        unfinished = FinishReason.FINISH_REASON_UNSPECIFIED
        continued = sum(1 for p in partial if p.completion_token_ids and p.finish_reason == unfinished)
        if continued:
            self.metrics.continued_samples.inc(continued)
            log.info("continuing group %s: %d episodes from %d tokens produced elsewhere (replayed into "
                     "fresh environments)", d.message.group_id, continued,
                     sum(len(p.completion_token_ids) for p in partial))
        self.episodes.start(d, d.message.group_id, d.message.prompt, d.message.reference or None, k,
                            lineage=lineage, partial=partial)

    def _emit(self, runs: list) -> int:
        for run in runs:
            if run.restarted:
                log.warning("group %s: %d handed-on episodes could not be replayed (the environment answered "
                            "differently) and started again", run.group_id, run.restarted)
            observe_episodes(self.metrics.episodes, run.episodes)
        return super()._emit(runs)

    def _rollout(self, run: EpisodeRun, now: float) -> RolloutGroup:  # type: ignore[override]
        return episode_group(run.tag.message, run.episodes, PolicyVersion(run.lineage, self.backend.version),
                             self.generator_id, run.started_at, now, self._decode)

    def _progress(self, run: EpisodeRun) -> PromptGroup:  # type: ignore[override]
        """The group with its episodes' transcripts (`asyncrlhf.envs.handon`), for another generator."""
        out = PromptGroup()
        out.CopyFrom(run.tag.message)
        del out.partial_samples[:]
        out.partial_samples.extend(s.partial() for s in run.samples)
        out.partial_lineage = run.lineage
        return out

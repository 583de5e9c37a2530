"""The episode loop (`task.env`): each prompt group is k multi-turn episodes, run by the library's
`EpisodeRunner`; each model turn of the batch is one backend call under the gate, so weight pushes land
between turns (each token records the version that sampled it), and environment steps run outside it.

    read <= batch_prompts PromptGroups -> run their episodes turn by turn -> XADD the RolloutGroups and XACK
    the prompts in one atomic step

This is batch mode (a batch's next turn waits for its slowest step); an episode's turns stay on this
generator, and a generator that stops leaves its groups pending, re-claimed and run again elsewhere.
`generator.mode: continuous` runs episodes in the continuous engine instead
(`services.generator.continuous_episodes`).
"""

from __future__ import annotations

import logging
import time
from contextlib import nullcontext

from asyncrlhf._proto.rollout_pb2 import PromptGroup
from asyncrlhf.config import Config
from asyncrlhf.cores import CoreShare
from asyncrlhf.envs.episode import Episode, EpisodeRunner, episode_limits
from asyncrlhf.envs.loading import EnvFactory
from asyncrlhf.envs.rollouts import episode_group
from asyncrlhf.sampling import Completion
from asyncrlhf.streams import Delivery
from asyncrlhf.version import PolicyVersion
from services.generator.loop import GeneratorLoop, PromptIO
from services.generator.metrics import EpisodeMetrics
from services.generator.server import WeightSwap

log = logging.getLogger(__name__)


class LineageChanged(RuntimeError):
    """Weights of a new learner lineage arrived mid-episode: its tokens would mix two lineages."""


class EpisodeLoop(GeneratorLoop):
    def __init__(self, cfg: Config, swap: WeightSwap, io: PromptIO, tokenizer, generator_id: str,
                 cores: CoreShare | None = None, envs: EnvFactory | None = None):
        super().__init__(cfg, swap, io, tokenizer, generator_id, cores)
        self.envs = envs or EnvFactory(cfg.task.env)
        limits = episode_limits(cfg, cfg.generator.sampling.max_new_tokens)
        self.runner = EpisodeRunner(tokenizer, self.envs, limits, cfg.model.system_prompt or "")

    def close(self) -> None:
        self.envs.close()  # an MCP server's process ends with its session

    def _generate(self, deliveries: list[Delivery[PromptGroup]]) -> int:
        work = self._admit(deliveries)
        if not work:
            return 0
        started_at, start = time.time(), time.perf_counter()
        lineage = self.swap.lineage
        prompts = [(d.message.prompt, d.message.reference or None) for d, _, _ in work]
        ks = [k for _, _, k in work]
        try:
            groups = self.runner.run(prompts, ks, lambda contexts, n: self._turn(contexts, n, lineage))
        except Exception as err:  # the backend failed (an environment's failure ends only its episode)
            log.exception("episode batch of %d groups failed", len(work))
            for d, _, _ in work:
                self.consumer.fail(d, f"{type(err).__name__}: {err}")
            self.metrics.failed_groups.inc(len(work))
            return 0
        version = PolicyVersion(lineage, self.backend.version)
        rollouts = [episode_group(d.message, episodes, version, self.generator_id, started_at, time.time(),
                                  self._decode) for (d, _, _), episodes in zip(work, groups, strict=True)]
        self.consumer.ack([d for d, _, _ in work], rollouts, to=self.producer)
        self._record_episodes([e for group in groups for e in group], time.perf_counter() - start)
        self.metrics.groups.inc(len(rollouts))
        return len(rollouts)

    def _turn(self, contexts: list[list[int]], max_tokens: int, lineage: int) -> tuple[list[Completion], int]:
        """One model turn of every running episode, under the gate (a push waits for it, not for an env)."""
        sampling = self.cfg.generator.sampling.model_copy(update={"max_new_tokens": max_tokens})
        with self.gate.generating(), (self.cores.busy() if self.cores else nullcontext()):
            if self.swap.lineage != lineage:
                raise LineageChanged("weights of a new learner lineage arrived mid-episode; the groups are "
                                     "retried")
            version = self.backend.version
            out = self.backend.generate(contexts, 1, sampling)
        return [group[0] for group in out], version

    def _record_episodes(self, episodes: list[Episode], seconds: float) -> None:
        observe_episodes(self.metrics.episodes, episodes)
        tokens = sum(sum(e.loss_mask) for e in episodes)  # the model's: environment tokens are not generated
        self.metrics.tokens.inc(tokens)
        self.metrics.written_tokens.inc(tokens)
        self.metrics.batch_seconds.observe(seconds)
        self.metrics.tokens_per_second.set(tokens / seconds if seconds > 0 else 0.0)


def observe_episodes(m: EpisodeMetrics, episodes: list[Episode]) -> None:
    """Each ended episode's turns, end, tool calls and errors, and environment step latencies."""
    for e in episodes:
        m.turns.observe(e.turns)
        m.ended.labels(end=e.end.split(":")[0]).inc()
        for name, n in e.tool_calls.items():
            m.tool_calls.labels(tool=name).inc(n)
        for name, n in e.tool_errors.items():
            m.tool_errors.labels(tool=name).inc(n)
        for s in e.step_seconds:
            m.step_seconds.observe(s)

"""Episodes (`task.env`): what a prompt group is with an environment, k multi-turn episodes of its prompt.

In batch mode the library's `EpisodeRunner` runs a batch's episodes turn by turn: each model turn of the batch
is one backend call under the gate, so weight pushes land between turns (each token records the version that
sampled it), and environment steps run outside it. A batch's next turn waits for its slowest step; an
episode's turns stay on this generator, and a generator that stops leaves its groups pending, re-claimed and
run again elsewhere. In continuous mode each episode's turns are engine sequences of the continuous sampler
(`asyncrlhf.envs.continuous.Episodes`), and a generator that stops hands its episodes on.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Sequence
from typing import Any

from asyncrlhf._proto.rollout_pb2 import RolloutGroup
from asyncrlhf.envs.continuous import Episodes, episodes_of
from asyncrlhf.envs.episode import Episode, EpisodeRunner, episode_limits
from asyncrlhf.envs.loading import EnvFactory
from asyncrlhf.envs.rollouts import episode_group
from asyncrlhf.sampling import Completion
from asyncrlhf.sampling.continuous import GroupRun
from asyncrlhf.version import PolicyVersion
from services.generator.loop import LoopContext, Work
from services.generator.metrics import EpisodeMetrics

log = logging.getLogger(__name__)


class LineageChanged(RuntimeError):
    """Weights of a new learner lineage arrived mid-episode: its tokens would mix two lineages."""


class EpisodeGroups:
    """k episodes per group (`GroupKind`), in environments made from `task.env`."""

    noun = "episodes"

    def __init__(self, ctx: LoopContext, envs: EnvFactory | None = None):
        cfg = ctx.cfg
        self.ctx = ctx
        self.envs = envs or EnvFactory(cfg.task.env)
        limits = episode_limits(cfg, cfg.generator.sampling.max_new_tokens)
        self.runner = EpisodeRunner(ctx.tokenizer, self.envs, limits, cfg.model.system_prompt or "")

    def generate(self, work: list[Work]) -> list[RolloutGroup]:
        """Every group's k episodes, run together turn by turn; their metrics observed."""
        ctx = self.ctx
        started_at, lineage = time.time(), ctx.swap.lineage
        prompts = [(w.delivery.message.prompt, w.delivery.message.reference or None) for w in work]
        groups = self.runner.run(prompts, [w.k for w in work],
                                 lambda contexts, n: self._turn(contexts, n, lineage))
        version = PolicyVersion(lineage, ctx.backend.version)
        observe_episodes(ctx.metrics.episodes, [e for group in groups for e in group])
        now = time.time()
        return [episode_group(w.delivery.message, episodes, version, ctx.generator_id, started_at, now,
                              ctx.decode) for w, episodes in zip(work, groups, strict=True)]

    def _turn(self, contexts: list[list[int]], max_tokens: int, lineage: int) -> tuple[list[Completion], int]:
        """One model turn of every running episode, under the gate (a push waits for it, not for an env)."""
        ctx = self.ctx
        sampling = ctx.cfg.generator.sampling.model_copy(update={"max_new_tokens": max_tokens})
        with ctx.gate.generating(), ctx.busy():
            if ctx.swap.lineage != lineage:
                raise LineageChanged("weights of a new learner lineage arrived mid-episode; the groups are "
                                     "retried")
            version = ctx.backend.version
            out = ctx.backend.generate(contexts, 1, sampling)
        return [group[0] for group in out], version

    def continuous(self) -> Episodes:
        return Episodes(self.runner)

    def observe(self, runs: Sequence[GroupRun[Any, Any]]) -> None:
        for run in runs:
            if run.restarted:
                log.warning("group %s: %d handed-on episodes could not be replayed (the environment answered "
                            "differently) and started again", run.group_id, run.restarted)
            observe_episodes(self.ctx.metrics.episodes, episodes_of(run))

    def close(self) -> None:
        self.envs.close()  # an MCP server's process ends with its session


def observe_episodes(m: EpisodeMetrics, episodes: list[Episode]) -> None:
    """Each ended episode's turns, end, tool calls and errors, and environment step latencies."""
    for e in episodes:
        assert e.end is not None, "only an ended episode is observed"
        m.turns.observe(e.turns)
        m.ended.labels(end=e.end.kind.value).inc()
        for name, n in e.tool_calls.items():
            m.tool_calls.labels(tool=name).inc(n)
        for name, n in e.tool_errors.items():
            m.tool_errors.labels(tool=name).inc(n)
        for s in e.step_seconds:
            m.step_seconds.observe(s)

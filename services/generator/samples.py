"""Single-turn samples: what a prompt group is without `task.env`, k completions of its prompt. In batch
mode one backend call samples a batch (one per distinct k, usually just one); in continuous mode each sample
is one engine sequence (`asyncrlhf.sampling.single_turn.Completions`)."""

from __future__ import annotations

import time
from collections.abc import Sequence
from itertools import groupby
from typing import Any

from asyncrlhf._proto.rollout_pb2 import RolloutGroup
from asyncrlhf.sampling import Completion
from asyncrlhf.sampling.continuous import GroupRun
from asyncrlhf.sampling.rollouts import rollout_group
from asyncrlhf.sampling.single_turn import Completions
from asyncrlhf.version import PolicyVersion
from services.generator.loop import LoopContext, Work


class SingleTurn:
    """k single-turn samples per group (`GroupKind`)."""

    noun = "samples"

    def __init__(self, ctx: LoopContext):
        self.ctx = ctx

    def generate(self, work: list[Work]) -> list[RolloutGroup]:
        """Every group's k completions, under the gate: one version samples the batch."""
        ctx = self.ctx
        started_at = time.time()
        with ctx.gate.generating(), ctx.busy():
            version = PolicyVersion(ctx.swap.lineage, ctx.backend.version)  # both change under the gate only
            completions = self._sample(work)
        generated_at = time.time()
        return [rollout_group(w.delivery.message, c, version, ctx.generator_id, started_at, generated_at,
                              ctx.decode) for w, c in zip(work, completions, strict=True)]

    def _sample(self, work: list[Work]) -> list[list[Completion]]:
        """Completions per work item, in order; one backend call per distinct k (usually just one)."""
        out: dict[int, list[Completion]] = {}
        order = sorted(range(len(work)), key=lambda i: work[i].k)
        for k, same_k in groupby(order, key=lambda i: work[i].k):
            idx = list(same_k)
            generated = self.ctx.backend.generate([work[i].ids for i in idx], k,
                                                  self.ctx.cfg.generator.sampling)
            out.update(zip(idx, generated, strict=True))
        return [out[i] for i in range(len(work))]

    def continuous(self) -> Completions:
        return Completions()

    def observe(self, runs: Sequence[GroupRun[Any, Any]]) -> None:
        return None  # a single-turn group's metrics are the loop's own

    def close(self) -> None:
        return None

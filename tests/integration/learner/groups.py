"""Scored groups for learner tests: random completions of the tiny model's vocabulary, chosen rewards."""

from __future__ import annotations

import torch

from asyncrlhf._proto.rollout_pb2 import FINISH_REASON_STOP, PromptGroup, RolloutGroup, Sample
from asyncrlhf.algorithms import StalenessDecision
from asyncrlhf.inbox.ids import group_id
from asyncrlhf.training.batch import TrainGroup


def scored_groups(n: int, k: int, *, seed: int = 0, version: int = 1, start: int = 0,
                  rewards: list[list[float]] | None = None, logprob: float = -1.0) -> list[RolloutGroup]:
    g = torch.Generator().manual_seed(seed)
    out = []
    for i in range(n):
        prompt = torch.randint(3, 259, (int(torch.randint(3, 8, (1,), generator=g)),), generator=g).tolist()
        samples = []
        for j in range(k):
            length = int(torch.randint(2, 7, (1,), generator=g))
            ids = torch.randint(3, 259, (length,), generator=g).tolist()
            reward = rewards[i][j] if rewards else float(j)  # sample j scores j: distinct, no ties
            samples.append(Sample(completion_token_ids=ids, logprobs=[logprob] * length,
                                  finish_reason=FINISH_REASON_STOP, text="", reward=reward))
        gid = group_id(start + i)
        out.append(RolloutGroup(group_id=gid, prompt=PromptGroup(group_id=gid, prompt_token_ids=prompt, k=k),
                                samples=samples, policy_version=version, generator_id="test"))
    return out


def train_groups(groups: list[RolloutGroup], corrected: list[bool] | None = None) -> list[TrainGroup]:
    """The groups as admitted for training: fresh, or (where `corrected`) one version beyond the bound and
    importance-corrected."""
    corrected = corrected or [False] * len(groups)
    return [TrainGroup(g, StalenessDecision(1, "correct") if c else StalenessDecision(0, "fresh"))
            for g, c in zip(groups, corrected, strict=True)]

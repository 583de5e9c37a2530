"""Rollout groups as scoring items, and a group with its scores filled in: what a reward replica does to
each group it reads, and what the in-process baseline (`asyncrlhf bench pipeline`) does without one."""

from __future__ import annotations

import time

from asyncrlhf._proto.rollout_pb2 import FINISH_REASON_STOP, RolloutGroup
from asyncrlhf.rewards.base import Item, ScoreResult


def items_of(group: RolloutGroup) -> list[Item]:
    """The group's samples as scoring items (a missing EOS is any finish reason but `stop`)."""
    return [
        Item(group.prompt.prompt, s.text, s.finish_reason == FINISH_REASON_STOP, len(s.completion_token_ids),
             group.prompt.reference or None)
        for s in group.samples
    ]


def scored(group: RolloutGroup, result: ScoreResult, offset: int, scorer_id: str) -> RolloutGroup:
    """A copy of `group` with its samples' rewards from `result[offset : offset + k]`, plus an episode's
    environment reward (`Sample.env_reward`, the component "env")."""
    out = RolloutGroup()
    out.CopyFrom(group)
    for i, sample in enumerate(out.samples):
        env = sample.env_reward if sample.HasField("env_reward") else 0.0
        sample.reward = result.scores[offset + i] + env
        sample.reward_components.clear()
        sample.reward_components.update({k: v[offset + i] for k, v in result.components.items()})
        if sample.HasField("env_reward"):
            sample.reward_components["env"] = sample.env_reward
    out.scored_at = time.time()
    out.scorer_id = scorer_id
    return out

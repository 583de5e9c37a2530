"""The judge as a reward scorer (`reward.scorers[].kind: judge`).

- `compare: single`: each completion is judged alone; its score is the judge's value (a number, a label's
  value, or the probability of the first choice), `parse_fail_reward` where the reply did not parse.
- `compare: pairwise`: the completions of one prompt (a rollout group: the items of a call that share a
  prompt) are compared two by two, every pair in both orders (k answers: k(k-1) calls), and each answer
  scores its mean share of its comparisons (`asyncrlhf.algorithms.pairwise_scores`): in [0, 1], the same
  whatever order the group's answers come in. An answer whose comparisons all failed to parse scores
  `parse_fail_reward`; a prompt with one answer has nothing to compare it with and scores 0.5.

Component `parse_failed` (under the scorer's label): the share of the sample's judge replies that did not
parse. Every call the batch needs goes to the judge at once (batching, `max_in_flight`).
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import torch

from asyncrlhf import algorithms as A
from asyncrlhf.rewards.base import ScoreResult
from asyncrlhf.rewards.judge.judge import Judge

ALONE = 0.5  # a pairwise answer with no rival: neither better nor worse


class JudgeScorer:
    def __init__(self, judge: Judge, parse_fail_reward: float):
        self.judge, self.parse_fail_reward = judge, parse_fail_reward
        self.pairwise = judge.cfg.compare == "pairwise"

    def score(
        self, prompts: Sequence[str], completions: Sequence[str], labels: Sequence[str] | None = None
    ) -> ScoreResult:
        references = list(labels) if labels is not None else [""] * len(prompts)
        truncated = self.judge.truncated
        if self.pairwise:
            scores, failed = self._pairwise(prompts, completions, references)
        else:
            values = self.judge.values([{"prompt": p, "completion": c, "reference": r}
                                        for p, c, r in zip(prompts, completions, references, strict=True)])
            scores = [self.parse_fail_reward if v is None else v for v in values]
            failed = [float(v is None) for v in values]
        return ScoreResult(scores, {"parse_failed": failed}, self.judge.truncated - truncated)

    def close(self) -> None:
        self.judge.close()

    def _pairwise(self, prompts: Sequence[str], completions: Sequence[str], references: Sequence[str],
                  ) -> tuple[list[float], list[float]]:
        groups = prompt_groups(prompts)
        plans = [(members, A.ordered_pairs(len(members))) for members in groups if len(members) > 1]
        requests = [{"prompt": prompts[members[0]], "completion_a": completions[members[a]],
                     "completion_b": completions[members[b]], "reference": references[members[0]]}
                    for members, pairs in plans for a, b in pairs.tolist()]
        values = iter(self.judge.values(requests))
        scores, failed = [ALONE] * len(prompts), [0.0] * len(prompts)
        for members, pairs in plans:
            got = [next(values) for _ in range(len(pairs))]
            valid = torch.tensor([v is not None for v in got])
            preference = torch.tensor([0.0 if v is None else v for v in got], dtype=torch.float64)
            shares = A.pairwise_scores(len(members), pairs, preference, valid)
            for slot, member in enumerate(members):
                share = shares[slot].item()
                scores[member] = self.parse_fail_reward if math.isnan(share) else share
                mine = (pairs == slot).any(dim=1)
                failed[member] = float((~valid[mine]).double().mean())
        return scores, failed


def prompt_groups(prompts: Sequence[str]) -> list[list[int]]:
    """Indices of the items of each distinct prompt, in order of first appearance."""
    groups: dict[str, list[int]] = {}
    for i, prompt in enumerate(prompts):
        groups.setdefault(prompt, []).append(i)
    return list(groups.values())

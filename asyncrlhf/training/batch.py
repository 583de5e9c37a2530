"""Scored `RolloutGroup`s -> padded tensors the objectives train on.

A group reaches training as a `TrainGroup`: the scored message and the staleness decision that admitted it
(`asyncrlhf.algorithms.staleness_decision`), so whether its tokens are importance-corrected travels with it:
every token of a corrected group in batch mode; in continuous mode, where a sample's tokens span versions
(`Sample.token_versions`), only the tokens beyond the bound (`StalenessDecision.corrects`).

Layout: prompts left-padded to a common width P, completions right after and right-padded to width T:
`input_ids` (B, P + T). Every completion starts at column P, so per-token tensors are (B, T) on the
*completion grid* (column j is completion token j, predicted by the logits at input position P - 1 + j),
and the model computes logits for those T positions only, not for the prompts. Position ids count real
tokens (as generation does with left padding). `mask` is 1 on real completion tokens the model sampled: an
episode's environment tokens (`Sample.loss_mask` 0) are in the sequence, attended to, and masked out of
every loss, KL and statistic that `mask` weighs.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field, fields, replace

import torch

from asyncrlhf._proto.rollout_pb2 import FINISH_REASON_STOP, RolloutGroup
from asyncrlhf.algorithms import StalenessDecision
from asyncrlhf.token_versions import oldest_version, sample_versions


@dataclass(frozen=True)
class TrainGroup:
    """One scored group admitted for training, with the staleness decision that admitted it."""

    message: RolloutGroup
    decision: StalenessDecision = StalenessDecision(0, "fresh")

    def token_versions(self) -> list[list[int]]:
        """Per sample, the version that sampled each completion token."""
        return [sample_versions(s, self.message.policy_version) for s in self.message.samples]

    def token_staleness(self) -> list[list[int]]:
        """Per sample, each completion token's staleness: the group's (its oldest token's) less how many
        versions newer the token is (never below 0: another lineage's versions do not compare)."""
        oldest, age = oldest_version(self.message), self.decision.staleness
        return [[max(0, age - (v - oldest)) for v in versions] for versions in self.token_versions()]

    def corrected_tokens(self) -> list[list[bool]]:
        """Per sample, whether each completion token is importance-corrected."""
        return [[self.decision.corrects(v) for v in versions] for versions in self.token_versions()]

    def fresh_tokens(self) -> list[list[bool]]:
        """Per sample, whether each completion token was sampled by the learner's own version: staleness 0,
        in a group whose tokens are judged one by one in the learner's lineage (within the bound, or spanning
        versions up to it; another lineage's versions never count as the learner's)."""
        judged = self.decision.action == "fresh" or self.decision.fresh_from is not None
        return [[judged and s == 0 for s in sample] for sample in self.token_staleness()]


def validate_group(group: RolloutGroup, k: int) -> str | None:
    """Why a scored group cannot be trained on, or None."""
    if len(group.samples) != k:
        return f"expected {k} samples, got {len(group.samples)}"
    if not group.prompt.prompt_token_ids:
        return "the prompt has no token ids"
    for i, s in enumerate(group.samples):
        if not s.HasField("reward"):
            return f"sample {i} has no reward (not scored)"
        if len(s.logprobs) != len(s.completion_token_ids):
            return f"sample {i}: {len(s.logprobs)} log-probs for {len(s.completion_token_ids)} tokens"
        if s.loss_mask and len(s.loss_mask) != len(s.completion_token_ids):
            return f"sample {i}: a loss mask of {len(s.loss_mask)} for {len(s.completion_token_ids)} tokens"
        if len(s.turn_rewards) > len(s.turn_ends) or any(
                not 0 < end <= len(s.completion_token_ids) or (s.loss_mask and not s.loss_mask[end - 1])
                for end in s.turn_ends):
            return f"sample {i}: turn ends {list(s.turn_ends)[:8]} or rewards do not fit its model's tokens"
    return None


@dataclass
class SequenceBatch:
    input_ids: torch.Tensor  # (B, P + T) long
    attention_mask: torch.Tensor  # (B, P + T) long
    mask: torch.Tensor  # (B, T) float, completion tokens the model sampled (an episode's env tokens: 0)
    behaviour_logps: torch.Tensor  # (B, T) generator's log-probs of the sampled tokens, 0 elsewhere
    scores: torch.Tensor  # (B,) rewards
    versions: torch.Tensor  # (B,) long, policy version that sampled each sequence
    group: torch.Tensor  # (B,) long, index of the sequence's group in the step
    sample: torch.Tensor  # (B,) long, index of the sample within its group
    eos: torch.Tensor  # (B,) bool, finished with EOS
    corrected: torch.Tensor  # (B,) bool, the group's staleness decision is "correct" (which tokens: below)
    corrected_tokens: torch.Tensor  # (B, T) bool, the token is importance-corrected; False on padding
    token_staleness: torch.Tensor  # (B, T) long, versions between the token's sampler and the learner; 0 pad
    fresh_tokens: torch.Tensor  # (B, T) bool, a real token sampled by the learner's version (no staleness)
    turn_rewards: torch.Tensor  # (B, T) an episode's per-turn rewards at each turn's last token; 0 elsewhere
    extras: dict[str, torch.Tensor] = field(default_factory=dict)  # per-row tensors added by objectives

    def __len__(self) -> int:
        return self.input_ids.shape[0]

    @property
    def completion_width(self) -> int:
        return self.mask.shape[1]

    @property
    def position_ids(self) -> torch.Tensor:
        return (self.attention_mask.cumsum(dim=1) - 1).clamp(min=0)

    @property
    def labels(self) -> torch.Tensor:
        """(B, T) completion token ids."""
        return self.input_ids[:, -self.completion_width :]

    def rows(self, index: torch.Tensor | Sequence[int]) -> SequenceBatch:
        """The sub-batch of rows `index` (every tensor and extra indexed along dim 0)."""
        index = torch.as_tensor(index, dtype=torch.long)
        tensors = [f.name for f in fields(self) if f.name != "extras"]
        picked = {name: getattr(self, name).index_select(0, index) for name in tensors}
        extras = {k: v.index_select(0, index) for k, v in self.extras.items()}
        return SequenceBatch(**picked, extras=extras)

    def to(self, device: torch.device) -> SequenceBatch:
        moved = {f.name: getattr(self, f.name).to(device) for f in fields(self) if f.name != "extras"}
        return SequenceBatch(**moved, extras={k: v.to(device) for k, v in self.extras.items()})

    def with_extras(self, **extras: torch.Tensor) -> SequenceBatch:
        return replace(self, extras={**self.extras, **extras})

    def scores_by_group(self) -> torch.Tensor:
        """(G, k) scores; requires every group to hold k samples, in order (as `build_batch` makes them)."""
        groups = int(self.group.max().item()) + 1
        return self.scores.view(groups, -1)


def build_batch(groups: Sequence[TrainGroup], pad_id: int) -> SequenceBatch:
    """Flatten G groups of k samples into B = G * k rows, group-major."""
    ks = {len(g.message.samples) for g in groups}
    if len(ks) != 1:
        raise ValueError(f"every group in a step must hold the same number of samples, got {sorted(ks)}")
    rows = [
        (list(g.message.prompt.prompt_token_ids), s, gi, si, g.message.policy_version, g.decision.corrected)
        for gi, g in enumerate(groups)
        for si, s in enumerate(g.message.samples)
    ]
    per_token = [triple for g in groups
                 for triple in zip(g.corrected_tokens(), g.token_staleness(), g.fresh_tokens(), strict=True)]
    width_p = max(len(p) for p, *_ in rows)
    width_t = max(1, max(len(s.completion_token_ids) for _, s, *_ in rows))
    b = len(rows)
    input_ids = torch.full((b, width_p + width_t), pad_id, dtype=torch.long)
    attention = torch.zeros((b, width_p + width_t), dtype=torch.long)
    mask = torch.zeros((b, width_t))
    behaviour = torch.zeros((b, width_t))
    corrected_tokens = torch.zeros((b, width_t), dtype=torch.bool)
    token_staleness = torch.zeros((b, width_t), dtype=torch.long)
    fresh_tokens = torch.zeros((b, width_t), dtype=torch.bool)
    turn_rewards = torch.zeros((b, width_t))
    for i, ((prompt, sample, *_rest), (corrected, staleness, fresh)) in enumerate(zip(rows, per_token,
                                                                                      strict=True)):
        completion = list(sample.completion_token_ids)
        n_p, n_c = len(prompt), len(completion)
        input_ids[i, width_p - n_p : width_p + n_c] = torch.tensor(prompt + completion, dtype=torch.long)
        attention[i, width_p - n_p : width_p + n_c] = 1
        mask[i, :n_c] = torch.tensor(list(sample.loss_mask), dtype=torch.float) if sample.loss_mask else 1.0
        behaviour[i, :n_c] = torch.tensor(list(sample.logprobs), dtype=torch.float)
        corrected_tokens[i, :n_c] = torch.tensor(corrected, dtype=torch.bool)
        token_staleness[i, :n_c] = torch.tensor(staleness, dtype=torch.long)
        fresh_tokens[i, :n_c] = torch.tensor(fresh, dtype=torch.bool) & mask[i, :n_c].bool()
        for end, reward in zip(sample.turn_ends, sample.turn_rewards, strict=False):  # a failed step: none
            turn_rewards[i, end - 1] += reward
    return SequenceBatch(
        input_ids=input_ids,
        attention_mask=attention,
        mask=mask,
        behaviour_logps=behaviour,
        scores=torch.tensor([s.reward for _, s, *_ in rows], dtype=torch.float),
        versions=torch.tensor([v for *_, v, _ in rows], dtype=torch.long),
        group=torch.tensor([gi for _, _, gi, *_ in rows], dtype=torch.long),
        sample=torch.tensor([si for _, _, _, si, *_ in rows], dtype=torch.long),
        eos=torch.tensor([s.finish_reason == FINISH_REASON_STOP for _, s, *_ in rows], dtype=torch.bool),
        corrected=torch.tensor([c for *_, c in rows], dtype=torch.bool),
        corrected_tokens=corrected_tokens,
        token_staleness=token_staleness,
        fresh_tokens=fresh_tokens,
        turn_rewards=turn_rewards,
    )

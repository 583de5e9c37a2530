"""One objective per `learner.algorithm`, composed from `asyncrlhf.algorithms` (the math lives there).

An objective turns a step's `SequenceBatch` into training items and a loss:
- `select(batch)`: the rows to train on, ordered in units of `unit` rows (a DPO pair is 2 rows), plus counts;
- `prepare(rows, frozen)`: per-row extras computed once per step from the frozen pass (advantages, returns);
- `loss(micro, logps, values, totals)`: the micro-batch's share of the step loss, normalised by the whole
  (mini-)batch's totals, so micro-batches sum to the full-batch loss whatever their sizes.

Tokens whose staleness decision is "correct" (`batch.corrected_tokens`, set by `learner.stale_policy` tis or
decoupled: every token of a corrected group in batch mode, only those beyond the bound when a sample's tokens
span versions) get importance weights from the behaviour log-probs, as the objective's `Correction` says:
truncated at `tis_cap`, or per-token masked above it (decoupled, AReaL). With `learner.rollout_correction`
none, every other token's behaviour log-prob is replaced by the proximal one, so its ratio is exactly 1 and
with no corrected tokens every objective is its on-policy self; with tis or mis every token is weighted for
the generator's numerics too, composed with the staleness weight (`algorithms.with_rollout_correction`). A
sequence-level weight (online DPO's pairs) is the product of its tokens' ratios, truncated.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Protocol

import torch

from asyncrlhf import algorithms as A
from asyncrlhf.config import Config, OnlineDPOLearnerConfig, PolicyGradientLearnerConfig, PPOLearnerConfig
from asyncrlhf.training.batch import SequenceBatch


@dataclass(frozen=True)
class Correction:
    """How rows are importance-weighted. Corrected (stale) tokens: per-token weights of kind `token_kind`
    ("tis" truncates at `cap`, "mis" drops tokens above it); sequence-level weights always truncated at `cap`.
    Every token: the rollout correction `rollout` ("none", "tis" or "mis" at `rollout_cap`)."""

    token_kind: A.ImportanceKind
    cap: float
    rollout: A.RolloutCorrection = "none"
    rollout_cap: float = 2.0

    @classmethod
    def from_config(cls, cfg: Config) -> Correction:
        lc = cfg.learner
        return cls("mis" if lc.stale_policy == "decoupled" else "tis", lc.tis_cap, lc.rollout_correction,
                   lc.rollout_correction_cap)

    def weighs(self, rows: SequenceBatch) -> bool:
        """Whether a token of `rows` may weigh other than 1: a row is corrected, or the rollout correction
        is on."""
        return self.rollout != "none" or bool(rows.corrected.any())

    def token_weights(self, rows: SequenceBatch, stale_kind: A.ImportanceKind | None = None) -> torch.Tensor:
        """(B, T) weights π_old / μ: `stale_kind` (default `token_kind`) at `cap` on corrected tokens (1
        elsewhere), composed with the rollout correction on every token."""
        old = rows.extras["old_logps"]
        stale = A.importance_weights(old, _behaviour_for_correction(rows), stale_kind or self.token_kind,
                                     self.cap)
        return A.with_rollout_correction(stale, rows.corrected_tokens, old, rows.behaviour_logps,
                                         self.rollout, self.rollout_cap)


@dataclass(frozen=True)
class Totals:
    """Normalisers of one (mini-)batch: real completion tokens and training items."""

    tokens: float
    items: float


@dataclass
class LossOut:
    policy: torch.Tensor
    value: torch.Tensor | None
    stats: dict[str, torch.Tensor]


class Objective(Protocol):
    unit: int  # rows per training item
    needs_reference: bool
    needs_values: bool
    needs_old_logps: bool  # pre-update log-probs of every row (else only when some row is corrected)

    def select(self, batch: SequenceBatch) -> tuple[SequenceBatch, dict[str, float]]: ...

    def prepare(self, rows: SequenceBatch) -> SequenceBatch: ...

    def loss(
        self, micro: SequenceBatch, logps: torch.Tensor, values: torch.Tensor | None, totals: Totals
    ) -> LossOut: ...


def _behaviour_for_correction(rows: SequenceBatch) -> torch.Tensor:
    """(B, T) behaviour log-probs on corrected tokens, the proximal (old) ones elsewhere (ratio 1)."""
    return torch.where(rows.corrected_tokens, rows.behaviour_logps, rows.extras["old_logps"])


class _KLMixin:
    """KL to the reference, in the reward or in the loss, with a fixed or adaptive coefficient."""

    def _init_kl(self, cfg: Config) -> None:
        kl = cfg.learner.kl
        self.kl_kind, self.kl_placement = kl.kind, kl.placement
        self.kl_controller = A.AdaptiveKLController(kl.coef, kl.target, kl.horizon) if kl.adaptive else None
        self.kl_fixed = kl.coef

    @property
    def kl_coef(self) -> float:
        return self.kl_controller.value if self.kl_controller else self.kl_fixed

    def observe_kl(self, mean_sequence_kl: float, n_samples: int) -> None:
        if self.kl_controller:
            self.kl_controller.update(mean_sequence_kl, n_samples)

    def _kl_loss_term(self, micro: SequenceBatch, logps: torch.Tensor, totals: Totals) -> torch.Tensor:
        if self.kl_placement != "loss" or self.kl_coef == 0.0:
            return logps.new_zeros(())
        kl = A.kl_penalty(logps, micro.extras["ref_logps"], self.kl_kind)
        return self.kl_coef * A.token_mean(kl, micro.mask, totals.tokens)

    def _reward_kl(self, rows: SequenceBatch) -> torch.Tensor:
        """(B, T) per-token KL of the sampled tokens between the pre-update policy and the reference."""
        return A.kl_penalty(rows.extras["old_logps"], rows.extras["ref_logps"], self.kl_kind) * rows.mask


class OnlineDPO:
    """Online DPO (Guo et al. 2024; the async-RLHF paper's main objective): best vs worst of k by reward."""

    unit, needs_reference, needs_values, needs_old_logps = 2, True, False, False

    def __init__(self, cfg: Config):
        lc = cfg.learner
        assert isinstance(lc, OnlineDPOLearnerConfig)  # make_objective picks this class by lc.algorithm
        dpo = lc.online_dpo
        self.beta, self.loss_type, self.label_smoothing = dpo.beta, dpo.loss_type, dpo.label_smoothing
        self.correction = Correction.from_config(cfg)

    def select(self, batch: SequenceBatch) -> tuple[SequenceBatch, dict[str, float]]:
        k = len(batch) // (int(batch.group.max()) + 1)
        chosen, rejected, valid = A.select_pairs(batch.scores_by_group())
        groups = torch.nonzero(valid).flatten()
        order = torch.stack([groups * k + chosen[groups], groups * k + rejected[groups]], dim=1).flatten()
        return batch.rows(order), {"pairs": float(len(groups)), "ties_skipped": float((~valid).sum())}

    def prepare(self, rows: SequenceBatch) -> SequenceBatch:
        return rows

    def loss(
        self, micro: SequenceBatch, logps: torch.Tensor, values: torch.Tensor | None, totals: Totals
    ) -> LossOut:
        seq = A.sequence_logprobs(logps, micro.mask)
        ref = A.sequence_logprobs(micro.extras["ref_logps"], micro.mask)
        loss, chosen_r, rejected_r = A.dpo_loss(
            seq[0::2], seq[1::2], ref[0::2], ref[1::2], self.beta, self.loss_type, self.label_smoothing,
            weights=self._pair_weights(micro), denominator=totals.items,
        )
        stats = {
            "chosen_rewards": chosen_r.mean(),
            "rejected_rewards": rejected_r.mean(),
            "reward_accuracy": (chosen_r > rejected_r).float().mean(),
            "reward_margin": (chosen_r - rejected_r).mean(),
            # sequence KL to the reference on the sampled completions (k1 estimate: mean log pi - log ref)
            "kl": (seq - ref).detach().mean(),
        }
        return LossOut(loss, None, stats)

    def _pair_weights(self, micro: SequenceBatch) -> torch.Tensor:
        """Sequence-level IS weight of each pair: the ratio over its corrected tokens, truncated (1 for fresh
        pairs), composed with the rollout correction's ratio over all its tokens."""
        c = self.correction
        if not c.weighs(micro):
            return torch.ones(len(micro) // 2)
        pair_old = _pair_sums(micro.extras["old_logps"], micro.mask)
        stale = torch.ones_like(pair_old)
        if micro.corrected.any():
            weights = A.importance_weights(pair_old, _pair_sums(_behaviour_for_correction(micro), micro.mask),
                                           "tis", c.cap)
            stale = torch.where(micro.corrected[0::2] | micro.corrected[1::2], weights, stale)
        tokens = micro.corrected_tokens.any(dim=1)
        behaviour = _pair_sums(micro.behaviour_logps, micro.mask)
        return A.with_rollout_correction(stale, tokens[0::2] | tokens[1::2], pair_old, behaviour, c.rollout,
                                         c.rollout_cap)


def _pair_sums(logps: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """(P,) the summed log-probs of each pair's two sequences (rows 2p and 2p + 1) from (2P, T) ones."""
    seq = A.sequence_logprobs(logps, mask)
    return seq[0::2] + seq[1::2]


class BestOfN:
    """Best-of-n fine-tuning (the seed's best-of-2): NLL of each group's highest-reward completion."""

    unit, needs_reference, needs_values, needs_old_logps = 1, False, False, False

    def __init__(self, cfg: Config):
        self.correction = Correction.from_config(cfg)

    def select(self, batch: SequenceBatch) -> tuple[SequenceBatch, dict[str, float]]:
        scores = batch.scores_by_group()
        best = A.best_of_n_select(scores)
        k = scores.shape[1]
        return batch.rows(torch.arange(len(best)) * k + best), {"selected": float(len(best))}

    def prepare(self, rows: SequenceBatch) -> SequenceBatch:
        return rows

    def loss(
        self, micro: SequenceBatch, logps: torch.Tensor, values: torch.Tensor | None, totals: Totals
    ) -> LossOut:
        weights = torch.ones_like(logps)
        if self.correction.weighs(micro):
            weights = self.correction.token_weights(micro, "tis")
        loss = A.best_of_n_loss(logps * weights, micro.mask, denominator=totals.tokens)
        return LossOut(loss, None, {"nll": A.masked_mean(-logps.detach(), micro.mask)})


class PolicyGradient(_KLMixin):
    """RLOO, GRPO, Dr. GRPO and REINFORCE++(-baseline): group advantages, clipped surrogate around the
    pre-update policy, importance-weighted where stale. An episode's per-turn rewards: REINFORCE++ keeps
    them at their turns (token-level returns); RLOO and the GRPOs compare sequences, on their sum."""

    unit, needs_reference, needs_values, needs_old_logps = 1, True, False, True

    def __init__(self, cfg: Config):
        lc = cfg.learner
        assert isinstance(lc, PolicyGradientLearnerConfig)  # make_objective picks this class by lc.algorithm
        self.algorithm, self.clip_eps = lc.algorithm, lc.policy_gradient.clip_eps
        self.correction = Correction.from_config(cfg)
        self._init_kl(cfg)
        self.needs_reference = self.kl_coef > 0 or lc.kl.adaptive

    def select(self, batch: SequenceBatch) -> tuple[SequenceBatch, dict[str, float]]:
        return batch, {}

    def prepare(self, rows: SequenceBatch) -> SequenceBatch:
        kl = self._reward_kl(rows) if self.needs_reference else torch.zeros_like(rows.mask)
        in_reward = self.kl_placement == "reward"
        if self.algorithm == "reinforce_pp":
            scores = rows.scores_by_group()
            coef = self.kl_coef if in_reward else 0.0
            advantages = A.reinforce_pp_baseline_advantages(scores, rows.mask, kl, coef,
                                                            turn_rewards=rows.turn_rewards)
        else:
            scores = rows.scores
            if in_reward:
                scores = scores - self.kl_coef * kl.sum(dim=1)
            grouped = scores.view(rows.scores_by_group().shape)
            per_sequence = _GROUP_ADVANTAGES[self.algorithm](grouped).flatten()
            advantages = per_sequence.unsqueeze(1) * rows.mask
        self.observe_kl(float(kl.sum(dim=1).mean()), len(rows))
        return rows.with_extras(advantages=advantages, reward_kl=kl.sum(dim=1))

    def loss(
        self, micro: SequenceBatch, logps: torch.Tensor, values: torch.Tensor | None, totals: Totals
    ) -> LossOut:
        loss, stats = A.decoupled_ppo_loss(
            logps, micro.extras["old_logps"], self.correction.token_weights(micro),
            micro.extras["advantages"], micro.mask, self.clip_eps, denominator=totals.tokens,
        )
        loss = loss + self._kl_loss_term(micro, logps, totals)
        stats["advantage_mean"] = A.masked_mean(micro.extras["advantages"], micro.mask)
        stats["kl"] = micro.extras["reward_kl"].mean()
        return LossOut(loss, None, stats)


_GROUP_ADVANTAGES = {
    "rloo": A.rloo_advantages,
    "grpo": lambda r: A.grpo_advantages(r, scale_by_std=True),
    "dr_grpo": lambda r: A.grpo_advantages(r, scale_by_std=False),
}


class PPO(_KLMixin):
    """PPO with a value model: KL-shaped per-token rewards (an episode's per-turn rewards at each turn's
    last token), GAE, clipped policy and value losses (Ziegler et al. 2019; Huang et al. 2024 for the
    details), several epochs of mini-batches per step."""

    unit, needs_reference, needs_values, needs_old_logps = 1, True, True, True

    def __init__(self, cfg: Config):
        lc = cfg.learner
        assert isinstance(lc, PPOLearnerConfig)  # make_objective picks this class by lc.algorithm
        self.ppo, self.correction = lc.ppo, Correction.from_config(cfg)
        self._init_kl(cfg)

    def select(self, batch: SequenceBatch) -> tuple[SequenceBatch, dict[str, float]]:
        return batch, {}

    def prepare(self, rows: SequenceBatch) -> SequenceBatch:
        kl = self._reward_kl(rows)
        coef = self.kl_coef if self.kl_placement == "reward" else 0.0
        rewards = A.shape_rewards(rows.scores, kl, rows.mask, coef, rows.turn_rewards)
        old_values = rows.extras["old_values"] * rows.mask
        advantages, returns = A.gae(rewards, old_values, rows.mask, self.ppo.gamma, self.ppo.lam)
        if self.ppo.whiten_advantages:
            advantages = A.whiten(advantages, rows.mask)
        self.observe_kl(float(kl.sum(dim=1).mean()), len(rows))
        return rows.with_extras(advantages=advantages, returns=returns, reward_kl=kl.sum(dim=1))

    def loss(
        self, micro: SequenceBatch, logps: torch.Tensor, values: torch.Tensor | None, totals: Totals
    ) -> LossOut:
        policy_loss, stats = A.decoupled_ppo_loss(
            logps, micro.extras["old_logps"], self.correction.token_weights(micro),
            micro.extras["advantages"], micro.mask, self.ppo.clip_eps, denominator=totals.tokens,
        )
        policy_loss = policy_loss + self._kl_loss_term(micro, logps, totals)
        if values is None:
            raise ValueError("PPO's loss needs the value model's values (needs_values is set)")
        value_loss = A.ppo_value_loss(
            values, micro.extras["old_values"], micro.extras["returns"], micro.mask, self.ppo.value_clip_eps,
            denominator=totals.tokens,
        )
        stats["value_loss"] = value_loss.detach()
        stats["kl"] = micro.extras["reward_kl"].mean()
        return LossOut(policy_loss, self.ppo.vf_coef * value_loss, stats)


OBJECTIVES: dict[str, Callable[[Config], Objective]] = {
    "online_dpo": OnlineDPO,
    "best_of_n": BestOfN,
    "rloo": PolicyGradient,
    "grpo": PolicyGradient,
    "dr_grpo": PolicyGradient,
    "reinforce_pp": PolicyGradient,
    "ppo": PPO,
}


def make_objective(cfg: Config) -> Objective:
    return OBJECTIVES[cfg.learner.algorithm](cfg)

"""The RLHF objectives as pure tensor functions: no I/O, no config objects, no torch.distributed.

Shapes: B sequences, T response tokens, G prompt groups of k samples; ``mask`` is 1 on real response tokens.
Services call these for all of their math.
"""

from asyncrlhf.algorithms.best_of_n import best_of_n_loss, best_of_n_select
from asyncrlhf.algorithms.dpo import DPOLossType, dpo_loss, select_pairs
from asyncrlhf.algorithms.dynamic_sampling import filter_reason, uninformative
from asyncrlhf.algorithms.evaluation import perplexity, sequence_kl, win_rate
from asyncrlhf.algorithms.grpo import grpo_advantages, grpo_loss
from asyncrlhf.algorithms.judging import (
    bootstrap_interval,
    judged_preference,
    ordered_pairs,
    pairwise_scores,
)
from asyncrlhf.algorithms.kl import AdaptiveKLController, KLKind, kl_penalty, shape_rewards
from asyncrlhf.algorithms.logprobs import sequence_logprobs, token_logprobs
from asyncrlhf.algorithms.masking import masked_mean, masked_sum, masked_var, token_mean
from asyncrlhf.algorithms.mismatch import MismatchTotals, mismatch_totals
from asyncrlhf.algorithms.offpolicy import (
    ImportanceKind,
    RolloutCorrection,
    StalenessDecision,
    StalenessMode,
    decoupled_ppo_loss,
    generates,
    generating_version,
    importance_weights,
    staleness_decision,
    with_rollout_correction,
)
from asyncrlhf.algorithms.ppo import clipped_surrogate, gae, ppo_policy_loss, ppo_value_loss, whiten
from asyncrlhf.algorithms.reinforce import (
    Normalization,
    policy_gradient_loss,
    reinforce_pp_advantages,
    reinforce_pp_baseline_advantages,
)
from asyncrlhf.algorithms.reward_model import bradley_terry_loss
from asyncrlhf.algorithms.rewards import missing_eos_penalty
from asyncrlhf.algorithms.rloo import rloo_advantages

__all__ = [
    "AdaptiveKLController",
    "DPOLossType",
    "ImportanceKind",
    "KLKind",
    "MismatchTotals",
    "Normalization",
    "RolloutCorrection",
    "StalenessDecision",
    "StalenessMode",
    "best_of_n_loss",
    "bootstrap_interval",
    "best_of_n_select",
    "bradley_terry_loss",
    "clipped_surrogate",
    "decoupled_ppo_loss",
    "dpo_loss",
    "filter_reason",
    "gae",
    "generates",
    "generating_version",
    "grpo_advantages",
    "grpo_loss",
    "importance_weights",
    "judged_preference",
    "kl_penalty",
    "masked_mean",
    "masked_sum",
    "masked_var",
    "mismatch_totals",
    "missing_eos_penalty",
    "ordered_pairs",
    "pairwise_scores",
    "perplexity",
    "policy_gradient_loss",
    "ppo_policy_loss",
    "ppo_value_loss",
    "reinforce_pp_advantages",
    "reinforce_pp_baseline_advantages",
    "rloo_advantages",
    "select_pairs",
    "sequence_kl",
    "sequence_logprobs",
    "shape_rewards",
    "staleness_decision",
    "token_logprobs",
    "token_mean",
    "uninformative",
    "whiten",
    "win_rate",
    "with_rollout_correction",
]

"""Dynamic sampling (DAPO, Yu et al. 2025, §3.2): a group whose k rewards are all equal teaches nothing.

Its group-relative advantages are zero everywhere (RLOO, GRPO, Dr. GRPO, REINFORCE++'s group baseline), its
best and worst completion tie (online DPO: no preference), or its "best" is an arbitrary pick (best-of-n).
Such a group is filtered before training and the step refilled with further groups. Equal means exactly
equal, as online DPO's tie (`select_pairs`).
"""

import torch

# Why a group is filtered, per algorithm (a metric label and the consumed log's `reason`).
_REASONS = {"online_dpo": "tied_pair", "best_of_n": "tied_best"}
ZERO_VARIANCE = "zero_variance"


def filter_reason(algorithm: str) -> str:
    """The name of what makes a group uninformative for `algorithm`."""
    return _REASONS.get(algorithm, ZERO_VARIANCE)


def uninformative(rewards: torch.Tensor) -> torch.Tensor:
    """(G, k) rewards -> (G,) bool: every reward of the group is the same (zero variance)."""
    if rewards.dim() != 2 or rewards.shape[1] < 2:
        raise ValueError(f"rewards must be (G, k) with k >= 2, got shape {tuple(rewards.shape)}")
    return rewards.amax(dim=1) == rewards.amin(dim=1)

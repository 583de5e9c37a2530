"""REINFORCE Leave-One-Out advantages (Ahmadian et al. 2024, "Back to Basics", eq. 6; Kool et al. 2019)."""

import torch


def rloo_advantages(rewards: torch.Tensor) -> torch.Tensor:
    """Each sample's reward minus the mean reward of the other k - 1 samples of its prompt.

    ``A_i = r_i - (Σ_j r_j - r_i) / (k - 1)``, which equals ``k / (k - 1) * (r_i - mean(r))``. The whole
    completion is one action: the policy-gradient loss weighs ``log π(y_i)`` by ``A_i``.

    Args:
        rewards: (G, k) sequence scores, k >= 2 samples per prompt.

    Returns:
        (G, k) advantages; each group sums to 0.
    """
    k = rewards.shape[-1]
    if rewards.dim() != 2 or k < 2:
        raise ValueError(f"rewards must be (G, k) with k >= 2, got shape {tuple(rewards.shape)}")
    leave_one_out_mean = (rewards.sum(dim=1, keepdim=True) - rewards) / (k - 1)
    return rewards - leave_one_out_mean

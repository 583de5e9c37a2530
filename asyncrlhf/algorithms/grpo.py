"""Group Relative Policy Optimization (Shao et al. 2024, "DeepSeekMath", §4.1, eq. 3 and 4).

Advantages are group-normalised outcome rewards. The loss is the clipped surrogate of PPO at token level,
with the KL to the reference added to the loss (not to the reward) using the k3 estimator of eq. 4.
Dr. GRPO (Liu et al. 2025, "Understanding R1-Zero-Like Training") drops the division by the group std.
"""

import torch

from asyncrlhf.algorithms.kl import kl_penalty
from asyncrlhf.algorithms.masking import masked_mean, token_mean
from asyncrlhf.algorithms.ppo import ppo_policy_loss


def grpo_advantages(rewards: torch.Tensor, scale_by_std: bool = True, eps: float = 1e-4) -> torch.Tensor:
    """``(r_i - mean(r)) / (std(r) + eps)`` within each prompt group.

    The paper writes ``std(r)`` without saying which; we use the *sample* std (Bessel's k - 1), as the
    reference implementations (TRL, OpenRLHF, verl) do, so their numbers match ours. For k = 2 this makes
    the advantages ±1/√2 whatever the reward gap.

    Args:
        rewards: (G, k) sequence scores, k >= 2.
        scale_by_std: False gives Dr. GRPO (mean-centred rewards only).
        eps: added to the std so that groups of equal rewards give 0, not NaN.

    Returns:
        (G, k) advantages.
    """
    if rewards.dim() != 2 or rewards.shape[1] < 2:
        raise ValueError(f"rewards must be (G, k) with k >= 2, got shape {tuple(rewards.shape)}")
    centred = rewards - rewards.mean(dim=1, keepdim=True)
    if not scale_by_std:
        return centred
    return centred / (rewards.std(dim=1, keepdim=True, correction=1) + eps)


def grpo_loss(
    logprobs: torch.Tensor,
    old_logprobs: torch.Tensor,
    advantages: torch.Tensor,
    mask: torch.Tensor,
    clip_eps: float,
    *,
    ref_logprobs: torch.Tensor | None = None,
    kl_coef: float = 0.0,
    denominator: float | torch.Tensor | None = None,
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """Token-level clipped surrogate plus ``kl_coef`` times the k3 KL to the reference.

    Token-level: every real token of the batch weighs the same (DAPO, Yu et al. 2025), rather than the
    paper's per-sequence 1/|o_i| mean, which under-weighs tokens of long responses.

    Args:
        logprobs: (B, T) log π_θ (with gradient). old_logprobs: (B, T) log π_old.
        advantages: (B,) per sequence (e.g. ``grpo_advantages(r).flatten()``) or (B, T) per token.
        mask: (B, T). clip_eps: ε.
        ref_logprobs: (B, T) log π_ref; needed when ``kl_coef`` > 0.
        kl_coef: β of eq. 3; 0 disables the term.
        denominator: token count to divide by instead of this batch's (see ``masking.token_mean``).

    Returns:
        loss: scalar. stats: ``clip_fraction``, ``approx_kl`` and, with a KL term, ``kl`` (to the reference).
    """
    if advantages.dim() == 1:
        advantages = advantages.unsqueeze(-1).expand_as(logprobs)
    loss, stats = ppo_policy_loss(logprobs, old_logprobs, advantages, mask, clip_eps, denominator=denominator)
    if kl_coef == 0.0:
        return loss, stats
    if ref_logprobs is None:
        raise ValueError("kl_coef > 0 needs ref_logprobs (the reference policy's token log-probs)")
    kl = kl_penalty(logprobs, ref_logprobs.detach(), "bregman")
    stats["kl"] = masked_mean(kl, mask).detach()
    return loss + kl_coef * token_mean(kl, mask, denominator), stats

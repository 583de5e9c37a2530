"""REINFORCE++ advantages and the plain policy-gradient loss.

REINFORCE++ (Hu 2025, "REINFORCE++: A Simple and Efficient Approach for Aligning LLMs", §3): token-level
returns of KL-shaped rewards (no critic), whitened over the whole batch. The -baseline variant first
subtracts the group-mean score of each prompt. Sequence- vs token-level loss normalisation: DAPO (Yu et al.
2025, §3.3).
"""

from collections.abc import Callable
from typing import Literal

import torch

from asyncrlhf.algorithms._choices import lookup
from asyncrlhf.algorithms.kl import shape_rewards
from asyncrlhf.algorithms.masking import masked_mean, token_mean
from asyncrlhf.algorithms.ppo import gae, whiten

Normalization = Literal["token", "sequence"]
Denominator = float | torch.Tensor | None


def reinforce_pp_advantages(
    scores: torch.Tensor,
    mask: torch.Tensor,
    kl: torch.Tensor | None = None,
    kl_coef: float = 0.0,
    gamma: float = 1.0,
    turn_rewards: torch.Tensor | None = None,
) -> torch.Tensor:
    """REINFORCE++: ``A_t = Σ_{s ≥ t} γ^(s-t) r_s`` of the KL-shaped rewards, whitened over the batch.

    Args:
        scores: (B,) sequence scores. mask: (B, T).
        kl: (B, T) per-token KL to the reference (``kl_penalty``); None means no penalty.
        kl_coef: β of the per-token penalty. gamma: discount (1 in the paper).
        turn_rewards: (B, T) an episode's per-turn rewards at each turn's last token, part of ``scores``
            (``shape_rewards``); None: the whole score on the last token.

    Returns:
        (B, T) advantages, 0 on masked positions.
    """
    kl = torch.zeros_like(mask, dtype=scores.dtype) if kl is None else kl
    rewards = shape_rewards(scores, kl, mask, kl_coef, turn_rewards)
    returns, _ = gae(rewards, torch.zeros_like(rewards), mask, gamma, 1.0)  # λ = 1, V = 0: returns-to-go
    return whiten(returns, mask)


def reinforce_pp_baseline_advantages(
    scores: torch.Tensor,
    mask: torch.Tensor,
    kl: torch.Tensor | None = None,
    kl_coef: float = 0.0,
    gamma: float = 1.0,
    turn_rewards: torch.Tensor | None = None,
) -> torch.Tensor:
    """REINFORCE++-baseline: subtract each prompt group's mean score, then as ``reinforce_pp_advantages``
    (per-turn rewards stay at their turns; the baseline is taken off the rest, on the last token).

    Args:
        scores: (G, k) sequence scores; rows of ``mask`` and ``kl`` are the G * k samples, group-major.
        mask: (G * k, T). kl, kl_coef, gamma, turn_rewards: as in ``reinforce_pp_advantages``.

    Returns:
        (G * k, T) advantages.
    """
    centred = scores - scores.mean(dim=1, keepdim=True)
    return reinforce_pp_advantages(centred.flatten(), mask, kl, kl_coef, gamma, turn_rewards)


def _sequence_mean(per_token: torch.Tensor, mask: torch.Tensor, denominator: Denominator) -> torch.Tensor:
    per_sequence = masked_mean(per_token, mask, dim=-1)
    return per_sequence.sum() / (per_sequence.shape[0] if denominator is None else denominator)


_NORMALIZATIONS: dict[str, Callable[[torch.Tensor, torch.Tensor, Denominator], torch.Tensor]] = {
    "token": token_mean,
    "sequence": _sequence_mean,
}


def policy_gradient_loss(
    logprobs: torch.Tensor,
    advantages: torch.Tensor,
    mask: torch.Tensor,
    normalization: Normalization = "token",
    *,
    denominator: Denominator = None,
) -> torch.Tensor:
    """Vanilla REINFORCE loss ``-A log π``, averaged over tokens or over sequences.

    Args:
        logprobs: (B, T) log π_θ (with gradient).
        advantages: (B,) per sequence or (B, T) per token.
        mask: (B, T).
        normalization: "token": every real token of the batch weighs the same; "sequence": each sequence's
            tokens are averaged first, then sequences weigh the same.
        denominator: what to divide the sum by instead of this batch's count: tokens for "token",
            sequences for "sequence" (pass the whole optimizer step's count when using micro-batches).

    Returns:
        scalar loss.
    """
    reduce = lookup(_NORMALIZATIONS, normalization, "normalization")
    if advantages.dim() == 1:
        advantages = advantages.unsqueeze(-1)
    return reduce(-advantages.detach() * logprobs, mask, denominator)

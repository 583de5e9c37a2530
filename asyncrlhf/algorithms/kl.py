"""Per-token KL penalties to the reference policy, KL-shaped rewards, and the adaptive KL coefficient.

With ℓ = log p - log q for the sampled token (p the policy, q the reference), the estimators are those of
Schulman 2020, "Approximating KL Divergence": k1 = ℓ, k2 = ½ ℓ², k3 = e^(-ℓ) - 1 + ℓ. ``jensen_shannon`` is
the sampled-token JS of the LoRA-PPO paper (Sidahmed et al. 2024, "Parameter Efficient RLHF").
"""

import math
from collections.abc import Callable
from typing import Literal

import torch
import torch.nn.functional as F

from asyncrlhf.algorithms._choices import lookup

KLKind = Literal["kl", "clamped_kl", "bregman", "squared_error", "jensen_shannon"]


def _k1(logprobs: torch.Tensor, ref_logprobs: torch.Tensor) -> torch.Tensor:
    return logprobs - ref_logprobs


def _clamped_k1(logprobs: torch.Tensor, ref_logprobs: torch.Tensor) -> torch.Tensor:
    return (logprobs - ref_logprobs).clamp(min=0.0)


def _bregman(logprobs: torch.Tensor, ref_logprobs: torch.Tensor) -> torch.Tensor:
    log_ratio = logprobs - ref_logprobs
    return torch.expm1(-log_ratio) + log_ratio  # expm1 keeps precision near ℓ = 0


def _squared_error(logprobs: torch.Tensor, ref_logprobs: torch.Tensor) -> torch.Tensor:
    return 0.5 * (logprobs - ref_logprobs) ** 2


def _jensen_shannon(logprobs: torch.Tensor, ref_logprobs: torch.Tensor) -> torch.Tensor:
    # With m = ½(p + q): log p - log m = log 2 - log(1 + q/p) = log 2 - softplus(-ℓ), and symmetrically for q.
    # Written in ℓ alone so that it is exactly 0 at ℓ = 0, like the other kinds.
    log_ratio = logprobs - ref_logprobs
    policy_term = (math.log(2.0) - F.softplus(-log_ratio)).clamp(min=0.0)
    ref_term = (math.log(2.0) - F.softplus(log_ratio)).clamp(min=0.0)
    return 0.5 * (policy_term + ref_term)


_KL_KINDS: dict[str, Callable[[torch.Tensor, torch.Tensor], torch.Tensor]] = {
    "kl": _k1,
    "clamped_kl": _clamped_k1,
    "bregman": _bregman,
    "squared_error": _squared_error,
    "jensen_shannon": _jensen_shannon,
}


def kl_penalty(logprobs: torch.Tensor, ref_logprobs: torch.Tensor, kind: KLKind = "kl") -> torch.Tensor:
    """Per-token divergence of the policy from the reference at the sampled tokens.

    Args:
        logprobs: (B, T) log p. ref_logprobs: (B, T) log q.
        kind: "kl" ℓ (k1, unbiased, can be < 0); "clamped_kl" max(0, ℓ); "bregman" e^(-ℓ) - 1 + ℓ (k3,
            unbiased, ≥ 0); "squared_error" ½ ℓ² (k2, ≥ 0); "jensen_shannon"
            ½[max(0, log p - log m) + max(0, log q - log m)] with m = ½(p + q) (≥ 0).

    Returns:
        (B, T); 0 wherever logprobs == ref_logprobs, for every kind.
    """
    return lookup(_KL_KINDS, kind, "kind")(logprobs, ref_logprobs)


def shape_rewards(
    scores: torch.Tensor,
    kl: torch.Tensor,
    mask: torch.Tensor,
    kl_coef: float,
    turn_rewards: torch.Tensor | None = None,
) -> torch.Tensor:
    """Per-token PPO rewards: ``-kl_coef * kl`` on every real token, plus the sequence score on the last one.

    Ziegler et al. 2019, eq. 2: R(x, y) = r(x, y) - β KL. A row with no real token gets no score. A
    multi-turn episode's per-turn rewards (``turn_rewards``, each at its turn's last token) stay where they
    are, and only the rest of the score, ``scores - turn_rewards.sum(-1)``, goes on the last real token: a
    row's rewards still sum to its score (less the KL), and a token is credited only with the rewards of its
    own turn and those after it.

    Args:
        scores: (B,) sequence scores (per-turn rewards included). kl: (B, T) per-token KL (``kl_penalty``).
        mask: (B, T). kl_coef: β. turn_rewards: (B, T), 0 except at each turn's last real token; None: none.

    Returns:
        (B, T) rewards, 0 on masked positions.
    """
    real = mask.to(kl.dtype)
    rewards = torch.where(mask.bool(), -kl_coef * kl, 0.0)
    if turn_rewards is not None:
        placed = torch.where(mask.bool(), turn_rewards.to(kl.dtype), 0.0)
        rewards = rewards + placed
        scores = scores.to(kl.dtype) - placed.sum(dim=1)
    positions = torch.arange(mask.shape[1], device=mask.device)
    last = (real * positions).argmax(dim=1, keepdim=True)  # index of the last real token
    has_tokens = real.sum(dim=1, keepdim=True) > 0
    score = torch.where(has_tokens, scores.to(kl.dtype).unsqueeze(1), 0.0)
    return rewards.scatter_add(1, last, score)


class AdaptiveKLController:
    """Adapts the KL coefficient β towards a target KL (Ziegler et al. 2019, §2.2).

    ``e = clip((KL - target) / target, -0.2, 0.2)`` and ``β ← β (1 + e * n_steps / horizon)``: β grows while
    the measured KL is above target and shrinks below it, by at most 20% per horizon.
    """

    def __init__(self, init_kl_coef: float, target: float, horizon: int) -> None:
        if init_kl_coef < 0 or target <= 0 or horizon <= 0:
            raise ValueError(
                f"need init_kl_coef >= 0, target > 0, horizon > 0; got {init_kl_coef}, {target}, {horizon}"
            )
        self.value = init_kl_coef
        self.target = target
        self.horizon = horizon

    def update(self, current_kl: float, n_steps: int) -> float:
        """Move β after ``n_steps`` samples measured a mean KL of ``current_kl``; returns the new β."""
        proportional_error = min(max((current_kl - self.target) / self.target, -0.2), 0.2)
        self.value *= 1 + proportional_error * n_steps / self.horizon
        return self.value

"""The training-inference mismatch: how far the generator's sampling log-probs are from the learner's for the
same tokens and the same weights (different kernels, batch shapes, bf16, FP8).

With Δ = log π_old - log μ per token (μ: the generator's behaviour log-prob, π_old: the learner's pre-update
log-prob) and the ratio r = π_old / μ = e^Δ: the mean and max of |Δ|, the k3 estimate of KL(μ ‖ π_old)
(Schulman 2020, "Approximating KL Divergence": r - 1 - log r, unbiased since the tokens were sampled from
μ), and the share of tokens whose ratio leaves [1/c, c] (what a correction capped at c would change). Totals,
not means, so that micro-batches add up (Liu, Li et al. 2025, "When Speed Kills Stability", for why these).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from asyncrlhf.algorithms.kl import kl_penalty


@dataclass(frozen=True)
class MismatchTotals:
    """Totals over a set of tokens: their count, Σ |Δ|, max |Δ|, Σ k3 and how many have a ratio outside
    [1/c, c]. `+` combines two sets."""

    tokens: float = 0.0
    abs_log_ratio_sum: float = 0.0
    abs_log_ratio_max: float = 0.0
    kl_sum: float = 0.0
    outside: float = 0.0

    def __add__(self, other: MismatchTotals) -> MismatchTotals:
        return MismatchTotals(self.tokens + other.tokens, self.abs_log_ratio_sum + other.abs_log_ratio_sum,
                              max(self.abs_log_ratio_max, other.abs_log_ratio_max),
                              self.kl_sum + other.kl_sum, self.outside + other.outside)

    def stats(self) -> dict[str, float]:
        """The step's figures (each 0 with no token): `mismatch_tokens`, `mismatch_abs_log_ratio_mean` and
        `_max`, `mismatch_kl` (per token) and `mismatch_outside_share`."""
        n = max(self.tokens, 1.0)
        return {"mismatch_tokens": self.tokens, "mismatch_abs_log_ratio_mean": self.abs_log_ratio_sum / n,
                "mismatch_abs_log_ratio_max": self.abs_log_ratio_max, "mismatch_kl": self.kl_sum / n,
                "mismatch_outside_share": self.outside / n}


def mismatch_totals(
    behaviour_logprobs: torch.Tensor, logprobs: torch.Tensor, mask: torch.Tensor, cap: float
) -> MismatchTotals:
    """The mismatch of the tokens `mask` selects.

    Args:
        behaviour_logprobs: (B, T) log μ, as the generator recorded them.
        logprobs: (B, T) log π_old, the learner's for the same weights (no gradient needed).
        mask: (B, T) 1 (or True) on the tokens to measure.
        cap: c >= 1: a ratio outside [1/c, c] counts as outside.
    """
    if cap < 1:
        raise ValueError(f"the ratio interval [1/c, c] needs c >= 1, got {cap}")
    real = mask.bool()
    behaviour, learner = behaviour_logprobs.detach()[real].double(), logprobs.detach()[real].double()
    log_ratio = learner - behaviour
    if log_ratio.numel() == 0:
        return MismatchTotals()
    k3 = kl_penalty(behaviour, learner, "bregman")  # ℓ = log μ - log π_old: e^(-ℓ) - 1 + ℓ = r - 1 - log r
    outside = log_ratio.abs() > torch.log(torch.tensor(float(cap), dtype=torch.float64))
    return MismatchTotals(float(real.sum()), float(log_ratio.abs().sum()), float(log_ratio.abs().max()),
                          float(k3.sum()), float(outside.sum()))

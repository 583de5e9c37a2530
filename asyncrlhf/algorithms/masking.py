"""Masked reductions shared by every objective.

``mask`` is 1 on real tokens and 0 on padding (binary; bool, int or float) and is broadcast against ``x``.
Masked positions are selected away, not multiplied by 0: they never contribute a value, not even a NaN or an
inf from padding, and receive no gradient.
"""

import torch


def masked_sum(x: torch.Tensor, mask: torch.Tensor, dim: int | None = None) -> torch.Tensor:
    """Sum of ``x`` over real positions: a scalar, or reduced over ``dim`` (e.g. (B, T) -> (B,) with -1)."""
    masked = torch.where(mask.bool(), x, 0.0)
    return masked.sum() if dim is None else masked.sum(dim)


def masked_mean(x: torch.Tensor, mask: torch.Tensor, dim: int | None = None) -> torch.Tensor:
    """Mean of ``x`` over real positions; 0 (not NaN) where there are none."""
    count = mask.to(x.dtype).expand_as(x)
    count = count.sum() if dim is None else count.sum(dim)
    return masked_sum(x, mask, dim) / count.clamp(min=1.0)


def masked_var(x: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """Population variance (divide by N, not N - 1) of ``x`` over all real positions: a scalar."""
    centered = x - masked_mean(x, mask)
    return masked_mean(centered**2, mask)


def token_mean(
    per_token: torch.Tensor, mask: torch.Tensor, denominator: float | torch.Tensor | None = None
) -> torch.Tensor:
    """Reduce a (B, T) per-token loss to a scalar: the masked sum divided by a token count.

    By default the count is this batch's real tokens (the token-mean). Pass ``denominator`` (the real tokens
    of the whole optimizer step) when a step is split into micro-batches: the micro-batch losses then sum to
    the loss of the full batch, whatever the lengths (DAPO, Yu et al. 2025, token-level loss).
    """
    if denominator is None:
        return masked_mean(per_token, mask)
    return masked_sum(per_token, mask) / denominator

"""Reward-model training: the Bradley-Terry pairwise loss (Bradley & Terry 1952; Ouyang et al. 2022, eq. 1).

P(chosen ≻ rejected) = σ(r_chosen − r_rejected),   loss = −log σ(r_chosen − r_rejected)
"""

import torch
import torch.nn.functional as F


def bradley_terry_loss(
    chosen: torch.Tensor, rejected: torch.Tensor, *, denominator: float | torch.Tensor | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """Mean negative log-likelihood of the preferences, and the fraction the scores order correctly.

    Args:
        chosen: (B,) reward-model scores of the preferred completions.
        rejected: (B,) scores of the other completions of the same prompts.
        denominator: pair count to divide the summed loss by instead of B (a step split into micro-batches
            then sums to the full batch's mean).

    Returns:
        (loss, accuracy): scalars; accuracy counts a pair right when r_chosen > r_rejected (ties are wrong,
        so an untrained constant scorer reads 0, not 0.5).
    """
    if chosen.shape != rejected.shape or chosen.dim() != 1:
        raise ValueError(
            f"chosen and rejected must both be (B,), got {tuple(chosen.shape)} and {tuple(rejected.shape)}"
        )
    margin = chosen.float() - rejected.float()
    nll = -F.logsigmoid(margin)
    loss = nll.mean() if denominator is None else nll.sum() / denominator
    accuracy = (margin > 0).float().mean()
    return loss, accuracy

"""Best-of-n fine-tuning: sample n completions, keep the highest-scoring one, maximise its likelihood.

Also called rejection-sampling fine-tuning (Touvron et al. 2023, Llama 2, §3.2.3); best-of-2 is the seed's
simplest online baseline (Noukhovitch et al. 2024, "Asynchronous RLHF").
"""

import torch

from asyncrlhf.algorithms.masking import token_mean


def best_of_n_select(rewards: torch.Tensor) -> torch.Tensor:
    """Index of the highest-reward sample in each group (the first on equal scores), (G, k) -> (G,)."""
    if rewards.dim() != 2:
        raise ValueError(f"rewards must be (G, k), got shape {tuple(rewards.shape)}")
    return rewards.argmax(dim=1)


def best_of_n_loss(
    token_logps: torch.Tensor, mask: torch.Tensor, *, denominator: float | torch.Tensor | None = None
) -> torch.Tensor:
    """Negative log-likelihood of the selected completions, token-mean (as in supervised fine-tuning).

    Args:
        token_logps: (G, T) log π_θ of the tokens of each group's selected completion.
        mask: (G, T).
        denominator: token count to divide by instead of this batch's (see ``masking.token_mean``).

    Returns:
        scalar loss.
    """
    return token_mean(-token_logps, mask, denominator)

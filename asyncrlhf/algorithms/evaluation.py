"""Evaluation measures of a policy against a reference: win rate under a gold reward, KL, perplexity.

Shapes: B prompts (one completion each), T completion tokens; ``mask`` is 1 on real completion tokens.
"""

import torch

from asyncrlhf.algorithms.masking import masked_mean, masked_sum


def win_rate(scores: torch.Tensor, reference_scores: torch.Tensor) -> torch.Tensor:
    """Fraction of prompts where the policy's completion beats the reference's under the gold reward.

    A tie counts half, so a policy identical to the reference has a win rate of exactly 0.5.

    Args:
        scores: (B,) gold reward of the policy's completion of each prompt.
        reference_scores: (B,) gold reward of the reference completion of the same prompts.

    Returns:
        scalar in [0, 1].
    """
    if scores.shape != reference_scores.shape or scores.dim() != 1 or scores.numel() == 0:
        raise ValueError(
            f"need two (B,) tensors with B > 0, got {tuple(scores.shape)} and {tuple(reference_scores.shape)}"
        )
    wins = (scores > reference_scores).double() + 0.5 * (scores == reference_scores).double()
    return wins.mean()


def sequence_kl(
    policy_logps: torch.Tensor, reference_logps: torch.Tensor, mask: torch.Tensor
) -> torch.Tensor:
    """Per-sequence KL estimate: the summed log-ratio log π(y_t | ·) − log π_ref(y_t | ·) of the generated
    tokens, (B, T) -> (B,). Its mean over prompts sampled from π estimates KL(π ‖ π_ref) (Stiennon et al.
    2020; the seed's eval KL)."""
    return masked_sum(policy_logps - reference_logps, mask, dim=-1)


def perplexity(logps: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """Per-sequence perplexity exp(−mean_t log p(y_t | ·)), (B, T) -> (B,); a sequence without tokens gets 1.

    With the reference policy's log-probs of the policy's completions this is the seed's measure of drift
    (how surprising the trained policy's text is to the model it started from)."""
    return torch.exp(-masked_mean(logps, mask, dim=-1))

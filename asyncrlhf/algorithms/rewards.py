"""Post-processing of sequence scores before they become advantages."""

import torch


def missing_eos_penalty(
    scores: torch.Tensor, ended_with_eos: torch.Tensor, penalty: float = -1.0
) -> torch.Tensor:
    """Replace the score of every sequence that did not end with EOS (truncated at the length limit).

    Reward models often score truncated text well; a fixed low score stops the policy from learning to
    ramble (Huang et al. 2024, "The N+ Implementation Details of RLHF with PPO"; the seed default is -1).

    Args:
        scores: (B,) sequence scores.
        ended_with_eos: (B,) bool, True where the completion ends with EOS (finish reason "stop").
        penalty: the score given to the others.

    Returns:
        (B,) scores.
    """
    return torch.where(ended_with_eos.bool(), scores, torch.full_like(scores, penalty))

"""Per-token and per-sequence log-probabilities of sampled tokens under a policy."""

import torch

from asyncrlhf.algorithms.masking import masked_sum


def token_logprobs(logits: torch.Tensor, labels: torch.Tensor, temperature: float = 1.0) -> torch.Tensor:
    """Log-probability of each label under ``softmax(logits / temperature)``.

    Use the generator's sampling temperature so that learner and behaviour log-probs describe the same
    distribution. Logits are upcast to float32 before the softmax.

    Args:
        logits: (B, T, V), already aligned so that ``logits[:, t]`` predicts ``labels[:, t]``.
        labels: (B, T) token ids.
        temperature: > 0.

    Returns:
        (B, T) log p(labels[b, t]).
    """
    if temperature <= 0:
        raise ValueError(f"temperature must be > 0, got {temperature}")
    scaled = logits.float() / temperature
    picked = scaled.gather(-1, labels.long().unsqueeze(-1)).squeeze(-1)
    return picked - torch.logsumexp(scaled, dim=-1)


def sequence_logprobs(token_logps: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """Log-probability of each whole response: the sum of its real tokens' log-probs, (B, T) -> (B,)."""
    return masked_sum(token_logps, mask, dim=-1)

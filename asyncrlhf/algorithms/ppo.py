"""PPO for language models: GAE, the clipped policy surrogate, the clipped value loss, whitening.

Schulman et al. 2017, "Proximal Policy Optimization Algorithms" (eq. 7 clipped surrogate, eq. 11-12 GAE from
Schulman et al. 2016). Value clipping and whitening follow Ziegler et al. 2019 and Huang et al. 2024,
"The N+ Implementation Details of RLHF with PPO". Each response token is one action; ``mask`` marks them.
"""

import torch

from asyncrlhf.algorithms.masking import masked_mean, masked_var, token_mean


def gae(
    rewards: torch.Tensor, values: torch.Tensor, mask: torch.Tensor, gamma: float, lam: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """Generalized advantage estimation (Schulman et al. 2016, eq. 16), right to left over real tokens.

    ``δ_t = r_t + γ V_{t+1} - V_t`` and ``A_t = δ_t + γ λ A_{t+1}``, where t+1 is the next *real* token: the
    value after the last real token is 0 (the episode ends), and masked tokens inside a response (e.g. tool
    output) are skipped rather than treated as an end. Computed without gradient.

    Args:
        rewards: (B, T) per-token rewards (see ``kl.shape_rewards``).
        values: (B, T) value estimates V_t.
        mask: (B, T) 1 on real response tokens.
        gamma: discount γ. lam: GAE λ.

    Returns:
        advantages: (B, T), 0 on masked positions.
        returns: (B, T) ``advantages + values``, the value targets, 0 on masked positions.
    """
    rewards, values, real = rewards.detach(), values.detach(), mask.bool()
    advantages = torch.zeros_like(values)
    next_value = torch.zeros_like(values[:, 0])
    next_advantage = torch.zeros_like(values[:, 0])
    for t in reversed(range(values.shape[1])):
        delta = rewards[:, t] + gamma * next_value - values[:, t]
        advantage = delta + gamma * lam * next_advantage
        advantages[:, t] = torch.where(real[:, t], advantage, 0.0)
        next_value = torch.where(real[:, t], values[:, t], next_value)
        next_advantage = torch.where(real[:, t], advantage, next_advantage)
    returns = torch.where(real, advantages + values, 0.0)
    return advantages, returns


def whiten(x: torch.Tensor, mask: torch.Tensor, shift_mean: bool = True, eps: float = 1e-8) -> torch.Tensor:
    """Normalise ``x`` to zero mean and unit (population) variance over all real positions of the batch.

    Args:
        x: (B, T). mask: (B, T).
        shift_mean: if False, only rescale and keep the mean (used for rewards).

    Returns:
        (B, T), 0 on masked positions.
    """
    mean = masked_mean(x, mask)
    whitened = (x - mean) * torch.rsqrt(masked_var(x, mask) + eps)
    if not shift_mean:
        whitened = whitened + mean
    return torch.where(mask.bool(), whitened, 0.0)


def clipped_surrogate(
    ratio: torch.Tensor, advantages: torch.Tensor, clip_eps: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """PPO's per-token pessimistic loss ``max(-A r, -A clip(r, 1 - ε, 1 + ε))`` (eq. 7, negated).

    Args:
        ratio: (B, T) probability ratio r = π_θ / π_old.
        advantages: (B, T).
        clip_eps: ε.

    Returns:
        per_token_loss: (B, T).
        clipped: (B, T) bool, True where the clipped term is the active one (no gradient flows there).
    """
    unclipped_loss = -advantages * ratio
    clipped_loss = -advantages * ratio.clamp(1.0 - clip_eps, 1.0 + clip_eps)
    return torch.maximum(unclipped_loss, clipped_loss), clipped_loss > unclipped_loss


def ppo_policy_loss(
    logprobs: torch.Tensor,
    old_logprobs: torch.Tensor,
    advantages: torch.Tensor,
    mask: torch.Tensor,
    clip_eps: float,
    *,
    denominator: float | torch.Tensor | None = None,
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """Clipped surrogate policy loss, token-mean over the batch.

    Args:
        logprobs: (B, T) log π_θ of the sampled tokens (with gradient).
        old_logprobs: (B, T) log π_old, the policy the advantages were estimated for.
        advantages: (B, T).
        mask: (B, T).
        clip_eps: ε of the ratio clip.
        denominator: token count to divide by instead of this batch's (see ``masking.token_mean``).

    Returns:
        loss: scalar.
        stats: detached scalars ``clip_fraction`` (share of real tokens where the clip is active) and
            ``approx_kl`` (k3 estimate of KL(π_old || π_θ): ``r - 1 - log r``).
    """
    log_ratio = logprobs - old_logprobs.detach()
    ratio = torch.exp(log_ratio)
    per_token_loss, clipped = clipped_surrogate(ratio, advantages.detach(), clip_eps)
    stats = {
        "clip_fraction": masked_mean(clipped.to(ratio.dtype), mask).detach(),
        "approx_kl": masked_mean((ratio - 1) - log_ratio, mask).detach(),
    }
    return token_mean(per_token_loss, mask, denominator), stats


def ppo_value_loss(
    values: torch.Tensor,
    old_values: torch.Tensor,
    returns: torch.Tensor,
    mask: torch.Tensor,
    clip_eps: float,
    *,
    denominator: float | torch.Tensor | None = None,
) -> torch.Tensor:
    """Clipped value loss ``0.5 max((V - R)^2, (V_clip - R)^2)``, token-mean over the batch.

    ``V_clip = V_old + clip(V - V_old, -ε, ε)`` keeps the value head near the values used for GAE.

    Args:
        values: (B, T) current value predictions (with gradient).
        old_values: (B, T) values at rollout time. returns: (B, T) targets from ``gae``.
        mask: (B, T). clip_eps: ε, in value units.
        denominator: token count to divide by instead of this batch's (see ``masking.token_mean``).

    Returns:
        scalar loss.
    """
    old_values, returns = old_values.detach(), returns.detach()
    clipped_values = old_values + (values - old_values).clamp(-clip_eps, clip_eps)
    per_token_loss = 0.5 * torch.maximum((values - returns) ** 2, (clipped_values - returns) ** 2)
    return token_mean(per_token_loss, mask, denominator)

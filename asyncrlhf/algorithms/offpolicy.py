"""Corrections for training on samples from an older policy than the one being updated.

A generator samples with behaviour log-probs log μ (recorded in the rollout, possibly several versions old
and computed by a different engine); the learner recomputes log π. Truncated IS: Yao et al. 2025, "Your
Efficient RL Framework Secretly Brings You Off-Policy RL Training" (tis, and masked IS "mis"). Decoupled
PPO: Fu et al. 2025, "AReaL", eq. 5, after Hilton et al. 2022, "Batch size-invariance for policy
optimization". Two corrections weight a token by its ratio π_prox / μ: the staleness correction (tokens
beyond the staleness bound) and the rollout correction (every token, for the engine's numerics:
`with_rollout_correction`).
"""

from collections.abc import Callable
from dataclasses import dataclass
from typing import Literal

import torch

from asyncrlhf.algorithms._choices import lookup
from asyncrlhf.algorithms.masking import masked_mean, token_mean
from asyncrlhf.algorithms.ppo import clipped_surrogate

ImportanceKind = Literal["is", "tis", "mis"]
RolloutCorrection = Literal["none", "tis", "mis"]

_IMPORTANCE_KINDS: dict[str, Callable[[torch.Tensor, float], torch.Tensor]] = {
    "is": lambda ratio, cap: ratio,
    "tis": lambda ratio, cap: ratio.clamp(max=cap),
    "mis": lambda ratio, cap: torch.where(ratio <= cap, ratio, 0.0),
}


def importance_weights(
    logprobs: torch.Tensor, behaviour_logprobs: torch.Tensor, kind: ImportanceKind = "tis", cap: float = 2.0
) -> torch.Tensor:
    """Per-token importance weights ``π / μ`` from the behaviour policy μ to the policy π, detached.

    Args:
        logprobs: (B, T) log π. behaviour_logprobs: (B, T) log μ, as recorded by the generator.
        kind: "is" the plain ratio; "tis" truncated, ``min(π / μ, cap)``; "mis" masked, the ratio where it is
            at most ``cap`` and 0 above (the token is dropped).
        cap: C, for "tis" and "mis".

    Returns:
        (B, T) weights, without gradient; exactly 1 where ``logprobs == behaviour_logprobs``.
    """
    truncate = lookup(_IMPORTANCE_KINDS, kind, "kind")
    return truncate(torch.exp(logprobs.detach() - behaviour_logprobs.detach()), cap)


def with_rollout_correction(
    stale_weights: torch.Tensor,
    corrected: torch.Tensor,
    proximal_logprobs: torch.Tensor,
    behaviour_logprobs: torch.Tensor,
    kind: RolloutCorrection,
    cap: float = 2.0,
) -> torch.Tensor:
    """The staleness correction's weights with the rollout correction's composed in: every token (or
    sequence) weighted by its ratio ``π_prox / μ`` under ``kind`` at ``cap``, fresh ones included.

    Where the staleness correction weights a token too, both bound the one ratio, so the weight is the
    smaller: the ratio truncated at the lower cap, times each mask (a token either one masks weighs 0), as
    veRL multiplies its IS weight by its rejection mask. The ratio itself counts once: multiplying the two
    weights, each already ``π_prox / μ``, would square it. Elsewhere the staleness weight is 1 and the
    rollout correction's applies alone.

    Args:
        stale_weights: (...) the staleness correction's weights (``importance_weights``; 1 off ``corrected``).
        corrected: (...) bool, where the staleness correction applies.
        proximal_logprobs, behaviour_logprobs: (...) log π_prox and log μ (of tokens, or of sequences: their
            sums over tokens).
        kind: "none" (``stale_weights`` unchanged), "tis" truncated or "mis" masked at ``cap``.

    Returns:
        (...) weights, without gradient.
    """
    if kind == "none":
        return stale_weights
    every = importance_weights(proximal_logprobs, behaviour_logprobs, kind, cap)
    return torch.where(corrected, torch.minimum(stale_weights, every), every)


def decoupled_ppo_loss(
    logprobs: torch.Tensor,
    proximal_logprobs: torch.Tensor,
    behaviour_weights: torch.Tensor,
    advantages: torch.Tensor,
    mask: torch.Tensor,
    clip_eps: float,
    *,
    denominator: float | torch.Tensor | None = None,
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """Decoupled PPO (AReaL eq. 5): clip around the proximal policy, importance-weight from the behaviour one.

    ``loss_t = w_t * max(-A r, -A clip(r, 1 - ε, 1 + ε))`` with ``r = π_θ / π_prox`` and ``w_t`` the bounded
    ``π_prox / μ``. The trust region is centred on π_prox (the learner's policy before this update) however
    stale μ is. With every weight 1 this is ``ppo_policy_loss``.

    Args:
        logprobs: (B, T) log π_θ (with gradient).
        proximal_logprobs: (B, T) log π_prox, recomputed by the learner before the update.
        behaviour_weights: (B, T) ``π_prox / μ`` bounded (``importance_weights``,
            ``with_rollout_correction``), μ the generator's behaviour policy.
        advantages: (B, T). mask: (B, T). clip_eps: ε.
        denominator: token count to divide by instead of this batch's (see ``masking.token_mean``).

    Returns:
        loss: scalar. stats: ``clip_fraction``, ``approx_kl`` (to π_prox) and ``behaviour_weight`` (the mean
        importance weight), detached.
    """
    weights = behaviour_weights.detach()
    log_ratio = logprobs - proximal_logprobs.detach()
    ratio = torch.exp(log_ratio)
    per_token_loss, clipped = clipped_surrogate(ratio, advantages.detach(), clip_eps)
    stats = {
        "clip_fraction": masked_mean(clipped.to(ratio.dtype), mask).detach(),
        "approx_kl": masked_mean((ratio - 1) - log_ratio, mask).detach(),
        "behaviour_weight": masked_mean(weights, mask),
    }
    return token_mean(weights * per_token_loss, mask, denominator), stats


StalePolicy = Literal["drop", "tis", "decoupled", "keep"]
StaleAction = Literal["fresh", "keep", "correct", "drop"]
_BEYOND_BOUND: dict[str, StaleAction] = {
    "drop": "drop", "keep": "keep", "tis": "correct", "decoupled": "correct"
}


@dataclass(frozen=True)
class StalenessDecision:
    """How old one group is and what training does with it.

    staleness: learner version - the version that generated the group (its oldest token; 0: on-policy).
    action: "fresh" (within the bound: trained as is), or, beyond it, "keep" (trained as is), "correct"
        (trained with importance weights from its behaviour log-probs) or "drop" (not trained).
    fresh_from: for a group whose tokens span versions (continuous mode) and reach back beyond the bound,
        the oldest version whose tokens are within it: tokens of that version or newer are fresh, older ones
        get `action`, as a whole group of their own staleness would. None: `action` holds for every token.
    """

    staleness: int
    action: StaleAction
    fresh_from: int | None = None

    @property
    def trained(self) -> bool:
        return self.action != "drop"

    @property
    def corrected(self) -> bool:
        return self.action == "correct"

    def corrects(self, token_version: int) -> bool:
        """Whether a token sampled by `token_version` is importance-corrected."""
        return self.corrected and (self.fresh_from is None or token_version < self.fresh_from)


def staleness_decision(
    generated_by: int, current: int, max_staleness: int, policy: StalePolicy, newest: int | None = None
) -> StalenessDecision:
    """The one place a group's staleness is measured and judged, on its oldest token; and per token.

    Args:
        generated_by: the policy version that sampled the group (its oldest token). current: the learner's
            version.
        max_staleness: how many versions old a group may be and still count as fresh; 0 is on-policy.
        policy: what happens beyond the bound: "drop", "keep", or importance-correct ("tis", "decoupled").
        newest: the newest version that sampled a token of the group, when its tokens span versions
            (continuous mode); its tokens within the bound are then fresh (`StalenessDecision.fresh_from`).
    """
    if max_staleness < 0:
        raise ValueError(f"max_staleness must be >= 0, got {max_staleness}")
    staleness = current - generated_by
    if staleness <= max_staleness:
        return StalenessDecision(staleness, "fresh")
    action = lookup(_BEYOND_BOUND, policy, "stale_policy")
    fresh_from = current - max_staleness
    if action == "drop" or newest is None or newest < fresh_from:  # one judgement for every token
        return StalenessDecision(staleness, action)
    return StalenessDecision(staleness, action, fresh_from)


StalenessMode = Literal["bound", "exact", "paper"]


def generating_version(trained_at: int, staleness: int, mode: StalenessMode) -> int:
    """The policy version that must generate the groups trained at version `trained_at` (versions start at 1,
    the initial policy), under a controlled staleness of `staleness` (N).

    "exact": ``max(1, v - N)``: every group is exactly N versions old, except in the first N steps, which
    train on the initial policy's groups (staleness 0, 1, ..., N - 1). "paper" (Noukhovitch et al. 2024,
    "Asynchronous RLHF", section 3): one policy generates N + 1 mini-batches, trained on in turn (staleness
    0 ... N), then the next policy generates the next N + 1; the paper's N is our N + 1. N = 0 is the
    synchronous run in both. "bound" controls nothing (staleness is only bounded): an error here.
    """
    if trained_at < 1 or staleness < 0:
        raise ValueError(f"need trained_at >= 1 and staleness >= 0, got {trained_at} and {staleness}")
    if mode == "exact":
        return max(1, trained_at - staleness)
    if mode == "paper":
        return trained_at - (trained_at - 1) % (staleness + 1)
    raise ValueError(f"staleness_mode {mode!r} does not fix a generating version (use exact or paper)")


def generates(version: int, staleness: int, mode: StalenessMode) -> bool:
    """Whether policy `version` generates any groups under the controlled `mode` (see `generating_version`):
    every version under "exact" (version u generates what is trained at u + N), every (N + 1)-th one from 1
    under "paper"."""
    if mode == "exact":
        return version >= 1
    return generating_version(version, staleness, mode) == version

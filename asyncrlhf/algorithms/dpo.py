"""Direct preference objectives on sequence log-probs, and pair selection for online DPO.

DPO: Rafailov et al. 2023, "Direct Preference Optimization", eq. 7. cDPO (label smoothing): Mitchell 2023,
"A note on DPO with noisy preferences". IPO: Azar et al. 2023, "A General Theoretical Paradigm to Understand
Learning from Human Preferences", eq. 17. Hinge: Zhao et al. 2023, "SLiC-HF", eq. 1 (as used by TRL).
Online DPO (Guo et al. 2024) samples k completions per prompt and pairs the best with the worst.
"""

from collections.abc import Callable
from typing import Literal

import torch
import torch.nn.functional as F

from asyncrlhf.algorithms._choices import lookup

DPOLossType = Literal["sigmoid", "ipo", "hinge"]


def _sigmoid(logits: torch.Tensor, beta: float, label_smoothing: float) -> torch.Tensor:
    # -log σ(β h), mixed with the flipped preference when labels are noisy (cDPO).
    agree, disagree = F.logsigmoid(beta * logits), F.logsigmoid(-beta * logits)
    return -(1 - label_smoothing) * agree - label_smoothing * disagree


def _ipo(logits: torch.Tensor, beta: float, label_smoothing: float) -> torch.Tensor:
    # IPO regresses the log-ratio difference h onto 1 / (2β) (β is IPO's τ).
    return (logits - 1 / (2 * beta)) ** 2


def _hinge(logits: torch.Tensor, beta: float, label_smoothing: float) -> torch.Tensor:
    return torch.relu(1 - beta * logits)


_LOSSES: dict[str, Callable[[torch.Tensor, float, float], torch.Tensor]] = {
    "sigmoid": _sigmoid,
    "ipo": _ipo,
    "hinge": _hinge,
}


def dpo_loss(
    policy_chosen_logps: torch.Tensor,
    policy_rejected_logps: torch.Tensor,
    ref_chosen_logps: torch.Tensor,
    ref_rejected_logps: torch.Tensor,
    beta: float,
    loss_type: DPOLossType = "sigmoid",
    label_smoothing: float = 0.0,
    *,
    weights: torch.Tensor | None = None,
    denominator: float | torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Preference loss on the difference of log-ratios
    ``h = (log π(y_w) - log π_ref(y_w)) - (log π(y_l) - log π_ref(y_l))``.

    Args:
        policy_chosen_logps, policy_rejected_logps: (B,) sequence log-probs under the policy.
        ref_chosen_logps, ref_rejected_logps: (B,) sequence log-probs under the frozen reference.
        beta: KL strength (β of DPO, τ of IPO), > 0.
        loss_type: "sigmoid" (DPO; cDPO with ``label_smoothing``), "ipo" or "hinge".
        label_smoothing: probability that a preference label is flipped, in [0, 0.5); sigmoid only.
        weights: (B,) per-pair weights (e.g. importance weights of stale pairs); None is all ones.
        denominator: pair count to divide the weighted sum by instead of B (a whole step's pairs when it is
            split into micro-batches, as ``masking.token_mean`` does for tokens).

    Returns:
        loss: scalar, the weighted sum over the B pairs divided by ``denominator`` (default B: the mean).
        chosen_rewards, rejected_rewards: (B,) implicit rewards ``β (log π - log π_ref)``, detached.
    """
    loss_fn = lookup(_LOSSES, loss_type, "loss_type")
    if beta <= 0:
        raise ValueError(f"beta must be > 0, got {beta}")
    if not 0.0 <= label_smoothing < 0.5:
        raise ValueError(f"label_smoothing must be in [0, 0.5), got {label_smoothing}")
    if label_smoothing and loss_type != "sigmoid":
        raise ValueError(f"label_smoothing applies to loss_type='sigmoid' only, not {loss_type!r}")
    chosen_logratios = policy_chosen_logps - ref_chosen_logps
    rejected_logratios = policy_rejected_logps - ref_rejected_logps
    losses = loss_fn(chosen_logratios - rejected_logratios, beta, label_smoothing)
    if weights is not None:
        losses = losses * weights
    loss = losses.sum() / (losses.numel() if denominator is None else denominator)
    return loss, beta * chosen_logratios.detach(), beta * rejected_logratios.detach()


def select_pairs(rewards: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Pick the highest- and lowest-reward sample of each prompt group as a (chosen, rejected) pair.

    Args:
        rewards: (G, k) scores of k >= 2 samples per prompt.

    Returns:
        chosen_idx, rejected_idx: (G,) indices into k (the first one on equal scores).
        valid: (G,) bool, False where the best and worst tie: such a pair carries no preference, so it is
            skipped (and counted by the caller) rather than trained on.
    """
    if rewards.dim() != 2 or rewards.shape[1] < 2:
        raise ValueError(f"rewards must be (G, k) with k >= 2, got shape {tuple(rewards.shape)}")
    chosen_idx = rewards.argmax(dim=1)
    rejected_idx = rewards.argmin(dim=1)
    return chosen_idx, rejected_idx, rewards.amax(dim=1) > rewards.amin(dim=1)

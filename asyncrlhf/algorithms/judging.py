"""A judge's comparisons as numbers: per-answer scores of a prompt group from pairwise preferences (each
pair asked in both orders, so a judge that favours a position favours every answer equally), and a policy's
judged win rate against reference answers with a bootstrap interval.

A preference v in [0, 1] is how much the judge prefers the answer it was shown first (A) over the second
(B): 1 A, 0 B, 0.5 a tie (or a judge that cannot tell).
"""

import math

import torch


def ordered_pairs(k: int) -> torch.Tensor:
    """(k(k-1), 2) every ordered pair (a, b), a != b, of k answers; both orders of a pair are adjacent:
    k=3 -> [[0, 1], [1, 0], [0, 2], [2, 0], [1, 2], [2, 1]]."""
    rows = [(a, b) for i in range(k) for j in range(i + 1, k) for a, b in ((i, j), (j, i))]
    return torch.tensor(rows, dtype=torch.long).reshape(-1, 2)


def pairwise_scores(k: int, pairs: torch.Tensor, preference: torch.Tensor, valid: torch.Tensor,
                    ) -> torch.Tensor:
    """(k,) each answer's mean share of the comparisons it was in: shown first it gets v, second 1 - v.

    Args:
        k: answers in the group.
        pairs: (P, 2) long, (index shown as A, index shown as B) of each comparison.
        preference: (P,) the judge's preference for A in each comparison.
        valid: (P,) bool, False where the judge's reply did not parse (left out of both answers' means).

    Returns:
        (k,) float64 in [0, 1]; NaN for an answer none of whose comparisons is valid.
    """
    shape = (pairs.shape[0],)
    if pairs.dim() != 2 or pairs.shape[1] != 2 or preference.shape != shape or valid.shape != shape:
        raise ValueError(f"need pairs (P, 2), preference and valid (P,); got {tuple(pairs.shape)}, "
                         f"{tuple(preference.shape)}, {tuple(valid.shape)}")
    shares: list[list[float]] = [[] for _ in range(k)]
    for (first, second), v in zip(pairs[valid].tolist(), preference.double()[valid].tolist(), strict=True):
        shares[first].append(v)
        shares[second].append(1 - v)
    # summed exactly (fsum), so the order the comparisons come in cannot move a score by one ulp: a group's
    # answers reversed get the same scores, bit for bit
    return torch.tensor([math.fsum(s) / len(s) if s else math.nan for s in shares], dtype=torch.float64)


def judged_preference(policy_first: torch.Tensor, policy_second: torch.Tensor, valid_first: torch.Tensor,
                      valid_second: torch.Tensor) -> torch.Tensor:
    """(B,) the judge's preference for the policy's answer over the reference's on each prompt, the mean
    of both orders: v (policy shown as A) and 1 - v' (policy shown as B). A prompt with one valid order
    uses it; with none, NaN. Inputs are (B,): preferences for A, and whether each parsed."""
    zero = torch.zeros(policy_first.shape, dtype=torch.float64)
    first = torch.where(valid_first, policy_first.double(), zero)
    second = torch.where(valid_second, 1 - policy_second.double(), zero)
    return (first + second) / (valid_first.double() + valid_second.double())


def bootstrap_interval(values: torch.Tensor, samples: int, confidence: float, seed: int = 0,
                       ) -> tuple[float, float]:
    """The percentile bootstrap interval of the mean of `values` (B,): `samples` resamples of B with
    replacement (seeded: the same values give the same interval), the (1 - confidence) / 2 and
    (1 + confidence) / 2 quantiles of their means."""
    if values.dim() != 1 or values.numel() == 0:
        raise ValueError(f"need (B,) values with B > 0, got {tuple(values.shape)}")
    generator = torch.Generator().manual_seed(seed)
    picks = torch.randint(values.numel(), (samples, values.numel()), generator=generator)
    means = values.double()[picks].mean(dim=1)
    tail = (1 - confidence) / 2
    low, high = torch.quantile(means, torch.tensor([tail, 1 - tail], dtype=torch.float64)).tolist()
    return low, high

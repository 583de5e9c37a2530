"""Sequence packing: a micro-batch's samples laid end to end in one row of real tokens, attention inside each.

The step's batch stays on the completion grid (`SequenceBatch`: (B, T) per-token tensors), so every
objective, advantage, KL term, mask and value stays aligned with its token exactly as in the padded batch.
Only the model's forward pass is packed:

- each row's prompt and completion tokens (no padding) follow each other in one row of L = sum of lengths;
- position ids restart at 0 for each sample (as the padded batch counts real tokens);
- attention inside each sample only: varlen attention (`asyncrlhf.training.varlen`: each sample's block on
  its own, for models whose attention goes through transformers' interface), else a 4D block-diagonal
  causal mask, additive (0 where a query may attend: an earlier or the same position of its own sample; the
  dtype's minimum elsewhere), which HF's eager and SDPA attention use as given, computing L x L positions;
- logits (and PPO values) are computed only at the positions that predict a completion token, then scattered
  back onto the (B, T) grid.

Micro-batches are made by tokens (`plan`): items to ranks longest first, each to the rank with the fewest
tokens so far, then each rank's items into micro-batches of at most `budget` tokens (first fit, longest
first); every rank runs the same number of micro-batches (collectives line up), the trainer pads the short.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from asyncrlhf.training.batch import SequenceBatch


@dataclass(frozen=True)
class PackedRow:
    """One micro-batch of B samples packed into a single row of L tokens; N completion tokens in all."""

    input_ids: torch.Tensor  # (1, L) long
    position_ids: torch.Tensor  # (1, L) long, 0 at each sample's first token
    segments: torch.Tensor  # (L,) long, the sample (row of the micro-batch) each token belongs to
    predict_at: torch.Tensor  # (N,) long, the positions whose output predicts a completion token (ascending)
    grid_rows: torch.Tensor  # (N,) long, where that token is on the (B, T) completion grid: row ...
    grid_cols: torch.Tensor  # (N,) long, ... and column
    labels: torch.Tensor  # (N,) long, the completion tokens

    @property
    def length(self) -> int:
        return self.input_ids.shape[1]

    def lengths(self) -> list[int]:
        """Each sample's tokens in the row, in order."""
        return torch.bincount(self.segments).tolist()

    def attention_mask(self, dtype: torch.dtype) -> torch.Tensor:
        """(1, 1, L, L) additive mask: 0 where query i may attend key j (same sample, j <= i), else the
        dtype's minimum."""
        same = self.segments.unsqueeze(1) == self.segments.unsqueeze(0)
        causal = torch.ones(self.length, self.length, dtype=torch.bool, device=same.device).tril()
        mask = torch.zeros(self.length, self.length, dtype=dtype, device=same.device)
        return mask.masked_fill(~(same & causal), torch.finfo(dtype).min)[None, None]

    def scatter(self, values: torch.Tensor, shape: torch.Size) -> torch.Tensor:
        """(N,) values at the completion tokens -> `shape` (B, T) on the grid, 0 elsewhere."""
        out = values.new_zeros(shape)
        out[self.grid_rows, self.grid_cols] = values
        return out


def row_tokens(batch: SequenceBatch) -> torch.Tensor:
    """(B,) real tokens (prompt and completion) of each row: its length when packed."""
    return batch.attention_mask.sum(dim=1)


def pack(micro: SequenceBatch) -> PackedRow:
    """Lay the micro-batch's rows end to end (padding removed) with the bookkeeping to scatter back."""
    width_p = micro.input_ids.shape[1] - micro.completion_width
    ids, positions, segments, predict_at, rows, cols = [], [], [], [], [], []
    offset = 0
    for b in range(len(micro)):
        real = micro.attention_mask[b].bool()
        tokens = micro.input_ids[b][real]
        n_p = int(real[:width_p].sum())
        n_c = int(real[width_p:].sum())  # every completion token, an episode's environment tokens included
        ids.append(tokens)
        positions.append(torch.arange(len(tokens)))
        segments.append(torch.full((len(tokens),), b, dtype=torch.long))
        predict_at.append(offset + n_p - 1 + torch.arange(n_c))  # token j is predicted one position earlier
        rows.append(torch.full((n_c,), b, dtype=torch.long))
        cols.append(torch.arange(n_c))
        offset += len(tokens)
    device = micro.input_ids.device
    grid_rows, grid_cols = torch.cat(rows).to(device), torch.cat(cols).to(device)
    return PackedRow(
        input_ids=torch.cat(ids).unsqueeze(0),
        position_ids=torch.cat(positions).unsqueeze(0).to(device),
        segments=torch.cat(segments).to(device),
        predict_at=torch.cat(predict_at).to(device),
        grid_rows=grid_rows,
        grid_cols=grid_cols,
        labels=micro.labels[grid_rows, grid_cols],
    )


def plan(tokens: Sequence[int], world: int, budget: int) -> list[list[list[int]]]:
    """Items (their token counts `tokens`) -> per rank, its micro-batches (lists of item indices, ascending).

    Ranks are balanced by tokens (longest item first, to the rank with the fewest tokens so far; ties to the
    lower rank), then each rank's items go into micro-batches of at most `budget` tokens (first fit, longest
    first; an item over the budget gets one of its own). Deterministic, so every rank computes the same plan.
    """
    order = sorted(range(len(tokens)), key=lambda i: (-tokens[i], i))
    loads, assigned = [0] * world, [[] for _ in range(world)]  # type: list[int], list[list[int]]
    for i in order:
        rank = min(range(world), key=lambda r: (loads[r], r))
        loads[rank] += tokens[i]
        assigned[rank].append(i)
    return [_first_fit(items, tokens, budget) for items in assigned]


def _first_fit(items: list[int], tokens: Sequence[int], budget: int) -> list[list[int]]:
    """`items`, longest first, into bins of at most `budget` tokens (first bin with room)."""
    bins: list[list[int]] = []
    room: list[int] = []
    for i in items:
        fit = next((b for b, left in enumerate(room) if left >= tokens[i]), None)
        if fit is None:
            bins.append([i])
            room.append(budget - tokens[i])
        else:
            bins[fit].append(i)
            room[fit] -= tokens[i]
    return [sorted(b) for b in bins]

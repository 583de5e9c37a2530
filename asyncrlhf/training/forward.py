"""How the trainer runs a model on its micro-batches: padded rows (`Padded`) or packed rows (`Packed`,
`learner.packing`). Both return per-token tensors on the (B, T) completion grid of `SequenceBatch`, so the
objectives never know which ran; they differ in how a step is cut into micro-batches (by sequences, or by
tokens) and in what they compute on (padding included, or real tokens only).
"""

from __future__ import annotations

import logging
import math
from dataclasses import dataclass
from typing import Protocol

import torch

from asyncrlhf import algorithms as A
from asyncrlhf.models import per_token_scores
from asyncrlhf.training import varlen
from asyncrlhf.training.batch import SequenceBatch
from asyncrlhf.training.packing import PackedRow, pack, plan, row_tokens

log = logging.getLogger("asyncrlhf.learner")


@dataclass
class Positions:
    """Token positions the model computed on in a step, and how many of them were real tokens."""

    computed: int = 0
    real: int = 0

    def add(self, micro: SequenceBatch, computed: int) -> None:
        self.computed += computed
        self.real += int(micro.attention_mask.sum())

    @property
    def padding_share(self) -> float:
        return 1.0 - self.real / self.computed if self.computed else 0.0


def padded_share(batch: SequenceBatch) -> float:
    """The share of padding in `batch`'s padded layout: what a padded step computes on."""
    return 1.0 - float(batch.attention_mask.sum()) / max(1, batch.input_ids.numel())


class PackingError(RuntimeError):
    """A model whose attention a packed row cannot reproduce."""


class Forward(Protocol):
    positions: Positions

    def logps(self, model, micro: SequenceBatch, temperature: float) -> torch.Tensor:
        """(B, T) log-probs of the completion tokens under `model`, 0 on padding."""

    def values(self, scorer, micro: SequenceBatch) -> torch.Tensor:
        """(B, T) value of the state before each completion token (the one that predicts it), 0 on padding."""

    def frozen_micros(self, rows: SequenceBatch) -> list[torch.Tensor]:
        """Row indices of each micro-batch of the frozen pass (every row once)."""

    def update_micros(self, minibatch: SequenceBatch, unit: int, rank: int, world: int) -> list[torch.Tensor]:
        """Item indices (an item is `unit` rows) of each of this rank's micro-batches; every rank gets the
        same number (an empty one is run on a copy of item 0 with its loss multiplied by zero)."""


class Padded:
    """Micro-batches of `micro_batch_size` sequences on the padded layout; each rank takes every world-th
    item."""

    def __init__(self, micro_batch_size: int):
        self.micro_batch_size, self.positions = micro_batch_size, Positions()

    def logps(self, model, micro: SequenceBatch, temperature: float) -> torch.Tensor:
        width = micro.completion_width
        self.positions.add(micro, micro.input_ids.numel())
        logits = model(input_ids=micro.input_ids, attention_mask=micro.attention_mask,
                       position_ids=micro.position_ids, logits_to_keep=width + 1).logits[:, :-1]
        return A.token_logprobs(logits.float(), micro.labels, temperature) * micro.mask

    def values(self, scorer, micro: SequenceBatch) -> torch.Tensor:
        width = micro.completion_width
        self.positions.add(micro, micro.input_ids.numel())
        values = per_token_scores(scorer, micro.input_ids, micro.attention_mask, micro.position_ids)
        return values[:, -width - 1 : -1].float() * micro.mask

    def frozen_micros(self, rows: SequenceBatch) -> list[torch.Tensor]:
        return list(torch.arange(len(rows)).split(self.micro_batch_size))

    def update_micros(self, minibatch: SequenceBatch, unit: int, rank: int, world: int) -> list[torch.Tensor]:
        items = len(minibatch) // unit
        mine = torch.arange(rank, items, world)
        per_micro = max(1, self.micro_batch_size // unit)
        n_micro = max(1, math.ceil(math.ceil(items / world) / per_micro))
        return [mine[m * per_micro : (m + 1) * per_micro] for m in range(n_micro)]


class Packed:
    """Micro-batches of at most `budget` tokens, each one packed row (`asyncrlhf.training.packing`); items
    balanced across ranks by tokens. Attention `varlen` (each sample's block alone, where the model supports
    it) or `mask` (the 4D block-diagonal mask)."""

    def __init__(self, budget: int, attention: str = "varlen"):
        self.budget, self.attention, self.positions = budget, attention, Positions()
        self._told_window = False

    def logps(self, model, micro: SequenceBatch, temperature: float) -> torch.Tensor:
        row = pack(micro)
        self.positions.add(micro, row.length)
        logits = model(input_ids=row.input_ids, position_ids=row.position_ids, logits_to_keep=row.predict_at,
                       **self._attention(model, row)).logits[0]
        logps = A.token_logprobs(logits.float(), row.labels, temperature)
        return row.scatter(logps, micro.mask.shape) * micro.mask  # an episode's env tokens: 0, as padded

    def values(self, scorer, micro: SequenceBatch) -> torch.Tensor:
        row = pack(micro)
        self.positions.add(micro, row.length)
        values = per_token_scores(scorer, row.input_ids, position_ids=row.position_ids,
                                  **self._attention(scorer, row))
        return row.scatter(values[0, row.predict_at].float(), micro.mask.shape) * micro.mask

    def _attention(self, model, row: PackedRow) -> dict:
        """How the row's samples are kept apart: their boundaries (varlen) or the block-diagonal mask. A model
        with sliding-window layers takes varlen where it can, `mask` or not: transformers gives every layer a
        4D mask as it is, so the mask would drop the window."""
        windowed = varlen.windowed(model)
        if (self.attention == "varlen" or windowed) and varlen.enable(model):
            if windowed and self.attention == "mask" and not self._told_window:
                log.warning("learner.pack_attention=mask: this model has sliding-window layers, which one 4D "
                            "mask cannot give; its packed rows take varlen attention")
                self._told_window = True
            return varlen.boundaries(row.lengths(), row.input_ids.device)
        if windowed:
            raise PackingError("this model has sliding-window layers and its attention is outside "
                               "transformers' attention interface, so a packed row cannot keep the window; "
                               "set learner.packing=false")
        return {"attention_mask": row.attention_mask(model.dtype)}

    def frozen_micros(self, rows: SequenceBatch) -> list[torch.Tensor]:
        (micros,) = plan(row_tokens(rows).tolist(), 1, self.budget)
        return [torch.tensor(m, dtype=torch.long) for m in micros]

    def update_micros(self, minibatch: SequenceBatch, unit: int, rank: int, world: int) -> list[torch.Tensor]:
        tokens = row_tokens(minibatch).view(-1, unit).sum(dim=1).tolist()
        per_rank = plan(tokens, world, self.budget)
        n_micro = max(1, max(len(micros) for micros in per_rank))
        mine = [torch.tensor(m, dtype=torch.long) for m in per_rank[rank]]
        return mine + [torch.zeros(0, dtype=torch.long)] * (n_micro - len(mine))


def make_forward(packing: bool, pack_tokens: int, micro_batch_size: int,
                 attention: str = "varlen") -> Forward:
    return Packed(pack_tokens, attention) if packing else Padded(micro_batch_size)

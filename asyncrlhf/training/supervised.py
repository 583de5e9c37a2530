"""Supervised-style training loops for the offline stages on the learner's DeepSpeed engine
(`asyncrlhf.training.engine`): AdamW, the schedule, ZeRO stage and clipping come from `learner.*`; the stage
sets its own learning rate, batch sizes and step count.

A step is `batch_size` examples in micro-batches of `micro_batch_size`; the loss of each micro-batch is
divided by the whole step's count (tokens or pairs), so the micro-batch gradients sum to the full batch's.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterator, Sequence

import torch
from torch import nn

from asyncrlhf.config import Config, LoraConfig
from asyncrlhf.training import engine as ds


def make_engine(
    model: nn.Module,
    cfg: Config,
    *,
    lr: float,
    micro_batch_size: int,
    total_steps: int,
    lora: LoraConfig | None = None,
):
    """A DeepSpeed engine (a world of one unless launched by torchrun/deepspeed) for a stage's training."""
    ds.init_distributed()
    update: dict[str, object] = {
        "lr": lr, "micro_batch_size": micro_batch_size, "total_steps": max(1, total_steps)
    }
    if lora is not None:
        update["lora"] = lora
    return ds.initialize(model, cfg.learner.model_copy(update=update))


def step_batches(n: int, batch_size: int, epochs: int, seed: int) -> Iterator[tuple[int, list[int]]]:
    """(epoch, example indices) for every optimizer step: a fresh seeded shuffle per epoch."""
    generator = torch.Generator().manual_seed(seed)
    for epoch in range(epochs):
        order = torch.randperm(n, generator=generator).tolist()
        for start in range(0, n, batch_size):
            yield epoch, order[start : start + batch_size]


def steps_per_run(n: int, batch_size: int, epochs: int) -> int:
    return epochs * math.ceil(n / batch_size)


def train_step(
    engine,
    indices: Sequence[int],
    micro_batch_size: int,
    micro_loss: Callable[[Sequence[int]], tuple[torch.Tensor, dict[str, float]]],
) -> dict[str, float]:
    """One optimizer step over `indices`; `micro_loss(micro_indices)` returns the micro-batch's share of the
    step loss and statistics to sum over the step."""
    totals: dict[str, float] = {}
    chunks = [indices[i : i + micro_batch_size] for i in range(0, len(indices), micro_batch_size)]
    for m, chunk in enumerate(chunks):
        engine.set_gradient_accumulation_boundary(m == len(chunks) - 1)
        loss, stats = micro_loss(chunk)
        engine.backward(loss, scale_wrt_gas=False)
        totals["loss"] = totals.get("loss", 0.0) + float(loss.detach())
        for key, value in stats.items():
            totals[key] = totals.get(key, 0.0) + value
    engine.step()
    return totals


def right_pad(rows: Sequence[Sequence[int]], pad_id: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(B, T) ids and attention mask, padded on the right (training: positions start at 0 in every row)."""
    width = max(len(r) for r in rows)
    ids = torch.full((len(rows), width), pad_id, dtype=torch.long)
    mask = torch.zeros((len(rows), width), dtype=torch.long)
    for i, row in enumerate(rows):
        ids[i, : len(row)] = torch.as_tensor(list(row), dtype=torch.long)
        mask[i, : len(row)] = 1
    return ids, mask

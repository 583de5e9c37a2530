"""One optimizer step on a step's scored groups: no Redis, no gRPC, so the synchronous path and the service
share it (and `max_staleness: 0` through the services equals feeding the same groups here).

A step: build the batch; the objective selects rows; a frozen pass records the pre-update log-probs (and
reference log-probs and values where needed); the objective prepares advantages; then epochs x mini-batches
of micro-batched backward passes, each rank taking every world-th training item, and one DeepSpeed step per
mini-batch. Losses are normalised by the whole mini-batch's totals, and multiplied by the world size because
DeepSpeed averages gradients over ranks: the sum over ranks and micro-batches is then the full-batch loss.

Every step measures the training-inference mismatch on the selected rows' fresh tokens (sampled by the
learner's own version: `SequenceBatch.fresh_tokens`), against the pre-update log-probs: the frozen pass's
where the step computes them, else the update pass's, which are the same weights' (an objective without a
frozen pass trains one epoch of one mini-batch, and the weights change only at its end; on several ranks,
this rank's share of the rows).
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Sequence

import torch

from asyncrlhf import algorithms as A
from asyncrlhf.config import Config, PPOLearnerConfig
from asyncrlhf.training.batch import SequenceBatch, TrainGroup, build_batch
from asyncrlhf.training.forward import Positions, make_forward, padded_share
from asyncrlhf.training.objectives import Objective, Totals
from asyncrlhf.training.policies import LearnerModels


class Trainer:
    def __init__(
        self,
        cfg: Config,
        models: LearnerModels,  # the policy's engine, the reference, the value model's engine (PPO)
        *,
        objective: Objective,
        pad_id: int,
        rank: int = 0,
        world: int = 1,
    ):
        self.cfg, self.policy, self.reference, self.value = cfg, models.policy, models.reference, models.value
        self.objective, self.pad_id, self.rank, self.world = objective, pad_id, rank, world
        self.temperature = cfg.generator.sampling.temperature
        lc = cfg.learner
        self.forward = make_forward(lc.packing, lc.pack_tokens, lc.micro_batch_size, lc.pack_attention)
        self.rollout_corrected, self.mismatch_cap = lc.rollout_correction != "none", lc.rollout_correction_cap
        self._mismatch = A.MismatchTotals()  # this step's, so far
        self._mismatch_in_update = False  # no frozen pre-update log-probs this step: measured in the update
        assert objective.needs_old_logps or self._passes() == (1, 1), \
            "an objective without a frozen pass must train one epoch of one mini-batch (its mismatch is " \
            "read from the update pass)"
        self.device = self.policy.device
        # Dropout off: the frozen pass and the update see the same function (ratio exactly 1 on-policy).
        self.policy.eval()
        if self.value is not None:
            self.value.eval()

    def train_step(self, groups: Sequence[TrainGroup], step_seed: int = 0) -> dict[str, float]:
        batch = build_batch(groups, self.pad_id)
        rows, counts = self.objective.select(batch)
        stats: dict[str, float] = {"reward_mean": float(batch.scores.mean()), **counts}
        if len(rows) == 0:
            return {**stats, "skipped_step": 1.0}
        self.forward.positions = Positions()
        rows = self._frozen_pass(rows.to(self.device))
        self._mismatch, self._mismatch_in_update = A.MismatchTotals(), "old_logps" not in rows.extras
        if not self._mismatch_in_update:
            self._measure(rows, rows.extras["old_logps"])
        rows = self.objective.prepare(rows)
        epochs, minibatches = self._passes()
        sums: dict[str, float] = defaultdict(float)
        n = 0
        generator = torch.Generator().manual_seed(step_seed)
        for _ in range(epochs):
            for minibatch in self._split(rows, minibatches, generator if epochs * minibatches > 1 else None):
                for key, value in self._update(minibatch).items():
                    sums[key] += value
                n += 1
        stats.update({key: value / n for key, value in sums.items()})
        stats["tokens"] = float(batch.mask.sum())
        stats["sequences"] = float(len(batch))
        stats["padding_share"] = self.forward.positions.padding_share
        stats["padding_share_unpacked"] = padded_share(rows)
        stats.update(self._mismatch.stats())
        return stats

    def _measure(self, rows: SequenceBatch, logps: torch.Tensor) -> None:
        """Add the mismatch of `rows`' fresh tokens; `logps`: (B, T) the learner's pre-update log-probs."""
        self._mismatch += A.mismatch_totals(rows.behaviour_logps, logps, rows.fresh_tokens, self.mismatch_cap)

    # -- the frozen pass --------------------------------------------------------------------------------

    @torch.no_grad()
    def _frozen_pass(self, rows: SequenceBatch) -> SequenceBatch:
        """Pre-update log-probs (when the objective, the rollout correction or a corrected row needs them),
        reference log-probs and values, once per step."""
        need_old = self.objective.needs_old_logps or self.rollout_corrected or bool(rows.corrected.any())
        wanted = {"old_logps": need_old, "ref_logps": self.objective.needs_reference,
                  "old_values": self.objective.needs_values}
        extras = {name: torch.zeros_like(rows.mask) for name, want in wanted.items() if want}
        for index in self.forward.frozen_micros(rows):
            micro = rows.rows(index)
            if need_old:
                extras["old_logps"][index] = self._logps(self.policy, micro)
            if self.objective.needs_reference:
                extras["ref_logps"][index] = self._logps(self.reference, micro)
            if self.objective.needs_values:
                extras["old_values"][index] = self._values(micro)
        return rows.with_extras(**extras)

    def _logps(self, model, micro: SequenceBatch) -> torch.Tensor:
        """(B, T) log-probs of the completion tokens, temperature applied as when sampling; logits only for
        the positions that predict them."""
        return self.forward.logps(model, micro, self.temperature)

    def _values(self, micro: SequenceBatch) -> torch.Tensor:
        """(B, T) value of the state before each completion token (the hidden state that predicts it)."""
        assert self.value is not None, "values are computed only for an objective with a value model"
        return self.forward.values(self.value.module, micro)

    # -- the update --------------------------------------------------------------------------------------

    def _passes(self) -> tuple[int, int]:
        lc = self.cfg.learner
        if isinstance(lc, PPOLearnerConfig):
            return lc.ppo.epochs, lc.ppo.minibatches
        return 1, 1

    def _split(
        self, rows: SequenceBatch, parts: int, generator: torch.Generator | None
    ) -> list[SequenceBatch]:
        unit = self.objective.unit
        units = len(rows) // unit
        order = torch.randperm(units, generator=generator) if generator is not None else torch.arange(units)
        chunks = [c for c in order.tensor_split(min(parts, units)) if len(c)]
        return [rows.rows(self._unit_rows(chunk)) for chunk in chunks]

    def _unit_rows(self, units: torch.Tensor) -> torch.Tensor:
        unit = self.objective.unit
        return (units.unsqueeze(1) * unit + torch.arange(unit)).flatten()

    def _update(self, minibatch: SequenceBatch) -> dict[str, float]:
        unit = self.objective.unit
        totals = Totals(tokens=float(minibatch.mask.sum()), items=float(len(minibatch) // unit))
        micros = self.forward.update_micros(minibatch, unit, self.rank, self.world)
        n_micro = len(micros)
        sums: dict[str, float] = defaultdict(float)
        real = 0
        for m, units in enumerate(micros):
            # A rank with fewer items still runs the same number of passes (collectives must line up),
            # on a copy of item 0 with its loss multiplied by zero.
            scale = float(self.world) if len(units) else 0.0
            micro = minibatch.rows(self._unit_rows(units if len(units) else torch.tensor([0])))
            boundary = m == n_micro - 1
            self.policy.set_gradient_accumulation_boundary(boundary)
            logps = self._logps(self.policy, micro)
            values = None
            if self.value is not None:
                self.value.set_gradient_accumulation_boundary(boundary)
                values = self._values(micro)
            out = self.objective.loss(micro, logps, values, totals)
            if self._mismatch_in_update and len(units):
                self._measure(micro, logps)
            self.policy.backward(out.policy * scale, scale_wrt_gas=False)
            if out.value is not None and self.value is not None:
                self.value.backward(out.value * scale, scale_wrt_gas=False)
            if len(units):
                real += 1
                sums["loss"] += float(out.policy.detach()) * self.world
                for key, value in out.stats.items():
                    sums[key] += float(value)
        self.policy.step()
        if self.value is not None:
            self.value.step()
        stats = {key: value / max(real, 1) for key, value in sums.items() if key != "loss"}
        stats["loss"] = sums["loss"]  # micro-batch shares add up to the mini-batch loss
        return stats

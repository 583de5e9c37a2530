"""Packing's layout and micro-batch plan (`asyncrlhf.training.packing`), with hand-made batches."""

import pytest
import torch

from asyncrlhf.training.batch import build_batch
from asyncrlhf.training.forward import Packed
from asyncrlhf.training.packing import pack, plan
from tests.integration.learner.groups import scored_groups, train_groups

pytestmark = pytest.mark.unit


def test_pack_lays_real_tokens_end_to_end_with_positions_restarting_per_sample():
    batch = build_batch(train_groups(scored_groups(2, 2, seed=1)), pad_id=0)
    row = pack(batch)
    lengths = batch.attention_mask.sum(dim=1).tolist()
    assert row.length == sum(lengths)  # no padding in the row
    expected_positions = torch.cat([torch.arange(n) for n in lengths])
    assert torch.equal(row.position_ids[0], expected_positions)
    # each completion token is predicted by the position just before it, in its own sample
    assert torch.equal(row.input_ids[0, row.predict_at + 1], row.labels)
    assert torch.equal(row.segments[row.predict_at], row.grid_rows)
    assert len(row.labels) == int(batch.mask.sum())


def test_plan_balances_ranks_by_tokens_not_by_count():
    # items of 90, 10, 10, 10, 10, 10, 10 tokens on 2 ranks: by count one rank would get 90 + 30 tokens and
    # the other 30; longest first to the lighter rank gives rank 0 the 90 and rank 1 the six tens (60)
    tokens = [10, 90, 10, 10, 10, 10, 10]
    ranks = plan(tokens, world=2, budget=100)
    loads = [sum(tokens[i] for micro in micros for i in micro) for micros in ranks]
    assert loads == [90, 60]
    assert sorted(i for micros in ranks for micro in micros for i in micro) == list(range(7))


def test_plan_fills_micro_batches_up_to_the_budget_and_gives_an_oversized_item_its_own():
    # 70 + 30 = 100 fit one budget of 100; 60 + 40 another; 150 is over the budget: alone
    (micros,) = plan([30, 150, 60, 70, 40], world=1, budget=100)
    assert sorted(micros) == [[0, 3], [1], [2, 4]]
    assert all(sum([30, 150, 60, 70, 40][i] for i in m) <= 100 for m in micros if len(m) > 1)


def test_every_rank_runs_the_same_number_of_packed_micro_batches_and_each_item_runs_once():
    batch = build_batch(train_groups(scored_groups(7, 2, seed=4)), pad_id=0)
    forward = Packed(budget=30)
    per_rank = [forward.update_micros(batch, 2, rank, 3) for rank in range(3)]
    assert len({len(micros) for micros in per_rank}) == 1
    items = sorted(int(i) for micros in per_rank for m in micros for i in m)
    assert items == list(range(7))  # DPO-like units of 2 rows: 7 items over 3 ranks

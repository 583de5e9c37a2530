"""The training-inference mismatch of a few tokens, by hand: Δ = log π_old - log μ, r = e^Δ."""

import math

import pytest
import torch

from asyncrlhf.algorithms import MismatchTotals, mismatch_totals

pytestmark = pytest.mark.unit

BEHAVIOUR = torch.tensor([[-1.0, -2.0, -0.5, -9.0]])  # log μ
# Δ = 0, ln 1.5, -ln 4 on the three real tokens (r = 1, 1.5, 0.25); the padded fourth is 9 nats off
LEARNER = torch.tensor([[-1.0, -2.0 + math.log(1.5), -0.5 - math.log(4.0), 0.0]])
MASK = torch.tensor([[1.0, 1.0, 1.0, 0.0]])


def test_the_mismatch_of_three_tokens():
    stats = mismatch_totals(BEHAVIOUR, LEARNER, MASK, cap=2.0).stats()
    # |Δ|: 0, 0.405465, 1.386294 -> mean 1.791759 / 3, max 1.386294 (the padded token's 9 is not counted)
    # k3 = r - 1 - ln r: 0, 0.5 - 0.405465 = 0.094535, 0.25 - 1 + 1.386294 = 0.636294 -> 0.730829 / 3
    # outside [1/2, 2]: only r = 0.25 -> 1/3
    assert stats == pytest.approx({"mismatch_tokens": 3.0, "mismatch_abs_log_ratio_mean": 0.597253,
                                   "mismatch_abs_log_ratio_max": 1.386294, "mismatch_kl": 0.243610,
                                   "mismatch_outside_share": 1 / 3}, abs=1e-6)


def test_micro_batches_add_up():
    first = mismatch_totals(BEHAVIOUR, LEARNER, MASK, cap=2.0)
    second = mismatch_totals(torch.tensor([[-2.0]]), torch.tensor([[-2.0 + math.log(3.0)]]), torch.ones(1, 1),
                             cap=2.0)  # r = 3: |Δ| 1.098612, k3 3 - 1 - 1.098612 = 0.901388, outside
    stats = (first + second).stats()
    assert stats == pytest.approx({"mismatch_tokens": 4.0,
                                   "mismatch_abs_log_ratio_mean": (1.791759 + 1.098612) / 4,
                                   "mismatch_abs_log_ratio_max": 1.386294,
                                   "mismatch_kl": (0.730829 + 0.901388) / 4, "mismatch_outside_share": 0.5},
                                  abs=1e-6)


def test_a_wider_cap_counts_fewer_tokens_outside():
    # r = 0.25 is inside [1/5, 5]
    assert mismatch_totals(BEHAVIOUR, LEARNER, MASK, cap=5.0).outside == 0.0


def test_no_token_gives_zeros_not_nan():
    totals = mismatch_totals(BEHAVIOUR, LEARNER, torch.zeros(1, 4), cap=2.0)
    assert totals == MismatchTotals()
    assert set(totals.stats().values()) == {0.0}


def test_a_cap_below_one_is_refused():
    with pytest.raises(ValueError, match=r"c >= 1"):
        mismatch_totals(BEHAVIOUR, LEARNER, MASK, cap=0.5)

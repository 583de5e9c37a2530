import math

import pytest
import torch
from torch.testing import assert_close

from asyncrlhf.algorithms import bradley_terry_loss

pytestmark = pytest.mark.unit


def test_bradley_terry_hand_computed():
    # margins: 2 - 1 = 1, 0 - 1 = -1, 3 - 3 = 0
    # -log σ(1) = log(1 + e^-1) ≈ 0.31326, -log σ(-1) = log(1 + e) ≈ 1.31326, -log σ(0) = log 2 ≈ 0.69315
    chosen, rejected = torch.tensor([2.0, 0.0, 3.0]), torch.tensor([1.0, 1.0, 3.0])
    loss, accuracy = bradley_terry_loss(chosen, rejected)
    expected = (math.log(1 + math.exp(-1)) + math.log(1 + math.e) + math.log(2)) / 3  # ≈ 0.77322
    assert_close(loss, torch.tensor(expected))
    assert_close(accuracy, torch.tensor(1 / 3))  # only the first pair is ordered right; the tie is wrong


def test_denominator_lets_micro_batches_sum_to_the_full_batch():
    chosen, rejected = torch.tensor([2.0, 0.0, 3.0, -1.0]), torch.tensor([1.0, 1.0, 3.0, 0.5])
    full, _ = bradley_terry_loss(chosen, rejected)
    halves = sum(bradley_terry_loss(chosen[i : i + 2], rejected[i : i + 2], denominator=4)[0] for i in (0, 2))
    assert_close(halves, full)


def test_gradient_raises_chosen_and_lowers_rejected():
    chosen, rejected = torch.tensor([0.0], requires_grad=True), torch.tensor([0.0], requires_grad=True)
    loss, _ = bradley_terry_loss(chosen, rejected)
    loss.backward()
    assert_close(chosen.grad, torch.tensor([-0.5]))  # d/dr_c -log σ(r_c - r_r) = -(1 - σ(0)) = -0.5
    assert_close(rejected.grad, torch.tensor([0.5]))


def test_shape_mismatch_fails():
    with pytest.raises(ValueError, match="both be"):
        bradley_terry_loss(torch.zeros(2), torch.zeros(3))

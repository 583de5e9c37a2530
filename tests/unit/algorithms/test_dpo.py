import math

import pytest
import torch
from torch.testing import assert_close

from asyncrlhf.algorithms import dpo_loss, select_pairs

pytestmark = pytest.mark.unit

# chosen log-ratio -1 - (-2) = 1, rejected log-ratio -3 - (-2) = -1, so h = 2; with β = 0.5, β h = 1
PAIR = (torch.tensor([-1.0]), torch.tensor([-3.0]), torch.tensor([-2.0]), torch.tensor([-2.0]))


def test_sigmoid_hand_computed():
    loss, chosen_rewards, rejected_rewards = dpo_loss(*PAIR, beta=0.5)
    assert_close(loss, torch.tensor(math.log(1 + math.exp(-1))))  # -log σ(1) = log(1 + e^-1) ≈ 0.3133
    assert_close(chosen_rewards, torch.tensor([0.5]))  # 0.5 * 1
    assert_close(rejected_rewards, torch.tensor([-0.5]))  # 0.5 * -1


def test_label_smoothing_is_cdpo():
    loss, _, _ = dpo_loss(*PAIR, beta=0.5, label_smoothing=0.1)
    # 0.9 * -log σ(1) + 0.1 * -log σ(-1) = 0.9 * 0.31326 + 0.1 * 1.31326 ≈ 0.41326
    expected = 0.9 * math.log(1 + math.exp(-1)) + 0.1 * math.log(1 + math.exp(1))
    assert_close(loss, torch.tensor(expected))


def test_ipo_hand_computed():
    loss, _, _ = dpo_loss(*PAIR, beta=0.5, loss_type="ipo")
    assert_close(loss, torch.tensor(1.0))  # (h - 1 / (2 β))^2 = (2 - 1)^2


def test_hinge_is_batch_mean():
    # pair 1: h = (-1 + 2) - (-3 + 2) = 2 -> relu(1 - 0.5 * 2) = 0
    # pair 2: h = (-1 + 2) - (-2 + 2) = 1 -> relu(1 - 0.5 * 1) = 0.5
    chosen = torch.tensor([-1.0, -1.0])
    rejected = torch.tensor([-3.0, -2.0])
    ref = torch.tensor([-2.0, -2.0])
    loss, _, _ = dpo_loss(chosen, rejected, ref, ref, beta=0.5, loss_type="hinge")
    assert_close(loss, torch.tensor(0.25))  # (0 + 0.5) / 2


def test_unknown_loss_type_lists_options():
    with pytest.raises(ValueError, match="valid options: 'sigmoid', 'ipo', 'hinge'"):
        dpo_loss(*PAIR, beta=0.5, loss_type="kto")


def test_label_smoothing_only_for_sigmoid():
    with pytest.raises(ValueError, match="label_smoothing applies to loss_type='sigmoid' only"):
        dpo_loss(*PAIR, beta=0.5, loss_type="ipo", label_smoothing=0.1)


@pytest.mark.parametrize("loss_type", ["sigmoid", "ipo", "hinge"])
def test_gradient_raises_chosen_and_lowers_rejected(loss_type):
    # h = 0: every loss type is still pushing the pair apart there
    chosen = torch.tensor([-2.0], requires_grad=True)
    rejected = torch.tensor([-2.0], requires_grad=True)
    ref = torch.tensor([-2.0])
    loss, chosen_rewards, _ = dpo_loss(chosen, rejected, ref, ref, beta=0.5, loss_type=loss_type)
    loss.backward()
    assert chosen.grad.item() < 0  # gradient descent increases log π(y_w)
    assert rejected.grad.item() > 0  # and decreases log π(y_l)
    assert not chosen_rewards.requires_grad


def test_select_pairs_with_ties():
    rewards = torch.tensor([[0.1, 0.9, 0.5], [0.3, 0.3, 0.3], [2.0, -1.0, 2.0]])
    chosen, rejected, valid = select_pairs(rewards)
    assert chosen.tolist() == [1, 0, 0]  # argmax; row 3 ties at the top -> first index
    assert rejected.tolist() == [0, 0, 1]  # argmin
    assert valid.tolist() == [True, False, True]  # row 2: best == worst, no preference


def test_select_pairs_needs_two_samples():
    with pytest.raises(ValueError, match="k >= 2"):
        select_pairs(torch.tensor([[1.0], [2.0]]))


def test_dpo_weights_and_denominator_split_a_batch_into_micro_batches():
    # pairs with log-ratio differences h = [1, -1, 0.5, 2]; beta 0.5 -> per-pair -logsigmoid(0.5 h)
    pc = torch.tensor([1.0, -1.0, 0.5, 2.0])
    zeros = torch.zeros(4)
    full, _, _ = dpo_loss(pc, zeros, zeros, zeros, beta=0.5)
    halves = [dpo_loss(pc[i : i + 2], zeros[:2], zeros[:2], zeros[:2], beta=0.5, denominator=4)[0]
              for i in (0, 2)]
    torch.testing.assert_close(halves[0] + halves[1], full)
    # weight 0 removes a pair from the sum but not from the denominator: (l0 + l1 + l3) / 4
    w = torch.tensor([1.0, 1.0, 0.0, 1.0])
    per_pair = -torch.nn.functional.logsigmoid(0.5 * pc)
    weighted, _, _ = dpo_loss(pc, zeros, zeros, zeros, beta=0.5, weights=w)
    torch.testing.assert_close(weighted, (per_pair[0] + per_pair[1] + per_pair[3]) / 4)

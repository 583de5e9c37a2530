import math

import pytest
import torch
from torch.testing import assert_close

from asyncrlhf.algorithms import grpo_advantages, grpo_loss, ppo_policy_loss

pytestmark = pytest.mark.unit


def test_advantages_use_sample_std():
    # mean 2; sample std sqrt((1 + 0 + 1) / (3 - 1)) = 1 (the population std would be sqrt(2/3) ≈ 0.816)
    advantages = grpo_advantages(torch.tensor([[1.0, 2.0, 3.0]]))
    assert_close(advantages, torch.tensor([[-1.0, 0.0, 1.0]]) / (1 + 1e-4))


def test_k2_advantages_are_plus_minus_one_over_root_two():
    # mean 0.5, sample std sqrt(2 * 0.25 / 1) = 1/√2; 0.5 / (1/√2) = 1/√2
    advantages = grpo_advantages(torch.tensor([[1.0, 0.0]]), eps=0.0)
    assert_close(advantages, torch.tensor([[1.0, -1.0]]) / math.sqrt(2))


def test_equal_rewards_give_zero_not_nan():
    assert_close(grpo_advantages(torch.tensor([[5.0, 5.0, 5.0]])), torch.zeros(1, 3))


def test_dr_grpo_only_centres():
    # k = 2: half the reward difference, whatever its size
    assert_close(grpo_advantages(torch.tensor([[1.0, 0.0]]), scale_by_std=False), torch.tensor([[0.5, -0.5]]))


def test_loss_without_kl_is_ppo_with_broadcast_advantages():
    g = torch.Generator().manual_seed(0)
    logprobs, old = -torch.rand(2, 3, generator=g), -torch.rand(2, 3, generator=g)
    mask = torch.tensor([[1, 1, 0], [1, 1, 1]])
    advantages = torch.tensor([0.7, -1.2])
    loss, _ = grpo_loss(logprobs, old, advantages, mask, 0.2)
    expected, _ = ppo_policy_loss(logprobs, old, advantages[:, None].expand(2, 3), mask, 0.2)
    assert_close(loss, expected)


def test_loss_with_kl_hand_computed():
    logprobs = torch.zeros(1, 2)  # ratio 1 against old: surrogate -A = -2 on both tokens
    ref = torch.tensor([[0.0, math.log(2.0)]])  # ℓ = 0, -log 2
    loss, stats = grpo_loss(logprobs, torch.zeros(1, 2), torch.tensor([2.0]), torch.ones(1, 2), 0.2,
                            ref_logprobs=ref, kl_coef=0.1)
    # k3 = e^-ℓ - 1 + ℓ: 0 and 2 - 1 - log 2 ≈ 0.30685; mean ≈ 0.15343
    kl = (2 - 1 - math.log(2.0)) / 2
    assert_close(stats["kl"], torch.tensor(kl))
    assert_close(loss, torch.tensor(-2.0 + 0.1 * kl))


def test_kl_term_needs_reference():
    with pytest.raises(ValueError, match="needs ref_logprobs"):
        grpo_loss(torch.zeros(1, 2), torch.zeros(1, 2), torch.ones(1), torch.ones(1, 2), 0.2, kl_coef=0.1)

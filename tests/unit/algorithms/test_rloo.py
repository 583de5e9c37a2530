import pytest
import torch
from torch.testing import assert_close

from asyncrlhf.algorithms import grpo_advantages, rloo_advantages

pytestmark = pytest.mark.unit


def test_k2_advantage_is_the_reward_difference():
    # k = 2: the leave-one-out baseline of a sample is the other sample, so A_i = r_i - r_j
    rewards = torch.tensor([[1.0, 0.0], [3.0, 5.0]])
    assert_close(rloo_advantages(rewards), torch.tensor([[1.0, -1.0], [-2.0, 2.0]]))


def test_k2_is_twice_the_group_centred_reward():
    # k / (k - 1) = 2: the group-centred (Dr. GRPO) advantage is half the reward difference, RLOO's the whole
    rewards = torch.tensor([[1.0, 0.0], [3.0, 5.0]])
    assert_close(rloo_advantages(rewards), 2 * grpo_advantages(rewards, scale_by_std=False))


def test_k3_hand_computed():
    # 1 - (2 + 6) / 2 = -3; 2 - (1 + 6) / 2 = -1.5; 6 - (1 + 2) / 2 = 4.5
    advantages = rloo_advantages(torch.tensor([[1.0, 2.0, 6.0]]))
    assert_close(advantages, torch.tensor([[-3.0, -1.5, 4.5]]))
    assert_close(advantages.sum(), torch.tensor(0.0))


def test_needs_two_samples():
    with pytest.raises(ValueError, match="k >= 2"):
        rloo_advantages(torch.tensor([[1.0]]))

import math

import pytest
import torch
from torch.testing import assert_close

from asyncrlhf.algorithms import gae, ppo_policy_loss, ppo_value_loss, whiten

pytestmark = pytest.mark.unit


def test_gae_gamma_1_lambda_1_is_returns_minus_values():
    rewards = torch.tensor([[0.0, 0.0, 1.0]])
    values = torch.tensor([[0.5, 0.2, 0.4]])
    advantages, returns = gae(rewards, values, torch.ones(1, 3), gamma=1.0, lam=1.0)
    # returns-to-go are 1, 1, 1; advantages = returns - values = 0.5, 0.8, 0.6
    assert_close(returns, torch.tensor([[1.0, 1.0, 1.0]]))
    assert_close(advantages, torch.tensor([[0.5, 0.8, 0.6]]))


def test_gae_hand_computed_with_padding():
    rewards = torch.tensor([[1.0, 0.0, 2.0, 7.0]])
    values = torch.tensor([[1.0, 2.0, 3.0, 9.0]])
    mask = torch.tensor([[1, 1, 1, 0]])  # the 7 and 9 are padding
    advantages, returns = gae(rewards, values, mask, gamma=0.9, lam=0.5)
    # t=2: δ = 2 + 0.9 * 0 - 3 = -1                 A = -1
    # t=1: δ = 0 + 0.9 * 3 - 2 = 0.7                A = 0.7 + 0.45 * -1 = 0.25
    # t=0: δ = 1 + 0.9 * 2 - 1 = 1.8                A = 1.8 + 0.45 * 0.25 = 1.9125
    assert_close(advantages, torch.tensor([[1.9125, 0.25, -1.0, 0.0]]))
    assert_close(returns, torch.tensor([[2.9125, 2.25, 2.0, 0.0]]))  # A + V, 0 on padding


def test_gae_skips_masked_tokens_inside_a_response():
    rewards = torch.tensor([[0.0, 5.0, 1.0]])
    values = torch.tensor([[0.5, 9.0, 0.25]])
    advantages, _ = gae(rewards, values, torch.tensor([[1, 0, 1]]), gamma=1.0, lam=1.0)
    # t=2: A = 1 - 0.25 = 0.75; t=1 is not an action; t=0: δ = 0 + 0.25 - 0.5 = -0.25, A = -0.25 + 0.75
    assert_close(advantages, torch.tensor([[0.5, 0.0, 0.75]]))


def test_gae_carries_no_gradient():
    values = torch.rand(2, 3, requires_grad=True)
    advantages, returns = gae(torch.rand(2, 3), values, torch.ones(2, 3), 1.0, 0.95)
    assert not advantages.requires_grad and not returns.requires_grad


def test_whiten_hand_computed():
    x = torch.tensor([[1.0, 2.0, 3.0, 4.0, 100.0]])
    mask = torch.tensor([[1, 1, 1, 1, 0]])
    # mean 2.5, population variance (2.25 + 0.25 + 0.25 + 2.25) / 4 = 1.25
    expected = torch.tensor([[-1.5, -0.5, 0.5, 1.5, 0.0]]) / math.sqrt(1.25)
    assert_close(whiten(x, mask), expected)
    assert_close(whiten(x, mask, shift_mean=False), (expected + 2.5) * mask)


# ratios r = 1, 1.5, 0.5 (and a padded token with absurd values); ε = 0.2
LOGPROBS = torch.tensor([[0.0, math.log(1.5), math.log(0.5), 50.0]])
OLD = torch.zeros(1, 4)
ADVANTAGES = torch.tensor([[1.0, 1.0, -1.0, 1e6]])
MASK = torch.tensor([[1, 1, 1, 0]])


def test_ppo_policy_loss_hand_computed():
    loss, stats = ppo_policy_loss(LOGPROBS, OLD, ADVANTAGES, MASK, clip_eps=0.2)
    # t0: r=1,   A=1:  max(-1,   -1)   = -1
    # t1: r=1.5, A=1:  max(-1.5, -1.2) = -1.2  (clipped)
    # t2: r=0.5, A=-1: max(0.5,  0.8)  = 0.8   (clipped)
    assert_close(loss, torch.tensor((-1.0 - 1.2 + 0.8) / 3))
    assert_close(stats["clip_fraction"], torch.tensor(2 / 3))
    # r - 1 - log r: 0, 0.5 - log 1.5, -0.5 - log 0.5
    approx_kl = (0.0 + (0.5 - math.log(1.5)) + (-0.5 - math.log(0.5))) / 3
    assert_close(stats["approx_kl"], torch.tensor(approx_kl))


def test_ppo_policy_loss_is_pessimistic_for_negative_advantage_above_clip():
    # r = 1.5, A = -1: max(1.5, 1.2) = 1.5, the unclipped term; not counted as clipped
    loss, stats = ppo_policy_loss(torch.tensor([[math.log(1.5)]]), torch.zeros(1, 1), -torch.ones(1, 1),
                                  torch.ones(1, 1), clip_eps=0.2)
    assert_close(loss, torch.tensor(1.5))
    assert stats["clip_fraction"].item() == 0.0


def test_ppo_policy_gradient_only_on_unclipped_real_tokens():
    logprobs = LOGPROBS.clone().requires_grad_(True)
    ppo_policy_loss(logprobs, OLD, ADVANTAGES, MASK, clip_eps=0.2)[0].backward()
    # d/dlogπ of -A r / 3 = -A r / 3 = -1/3 at t0; clipped t1, t2 and padded t3 get 0
    assert_close(logprobs.grad, torch.tensor([[-1 / 3, 0.0, 0.0, 0.0]]))


def test_ppo_value_loss_hand_computed():
    values = torch.tensor([[1.0, 2.0, 50.0]])
    old_values = torch.tensor([[0.5, 2.5, 0.0]])
    returns = torch.tensor([[2.0, 2.0, 0.0]])
    loss = ppo_value_loss(values, old_values, returns, torch.tensor([[1, 1, 0]]), clip_eps=0.2)
    # t0: V_clip = 0.5 + 0.2 = 0.7; 0.5 * max((1 - 2)^2, (0.7 - 2)^2) = 0.5 * 1.69 = 0.845
    # t1: V_clip = 2.5 - 0.2 = 2.3; 0.5 * max(0^2, 0.3^2) = 0.045
    assert_close(loss, torch.tensor((0.845 + 0.045) / 2))

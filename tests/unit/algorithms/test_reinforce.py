import math

import pytest
import torch
from torch.testing import assert_close

from asyncrlhf.algorithms import (
    policy_gradient_loss,
    reinforce_pp_advantages,
    reinforce_pp_baseline_advantages,
)

pytestmark = pytest.mark.unit


def test_reinforce_pp_returns_whitened_over_batch():
    mask = torch.tensor([[1, 1], [1, 0]])
    advantages = reinforce_pp_advantages(torch.tensor([1.0, -1.0]), mask)
    # rewards (0, 1 | -1, pad); returns-to-go (1, 1 | -1); mean 1/3,
    # variance ((2/3)^2 + (2/3)^2 + (4/3)^2) / 3 = 8/9, std 2√2/3: (2/3)/(2√2/3) = 1/√2, (-4/3)/(2√2/3) = -√2
    expected = torch.tensor([[1 / math.sqrt(2), 1 / math.sqrt(2)], [-math.sqrt(2), 0.0]])
    assert_close(advantages, expected)


def test_reinforce_pp_with_kl_penalty():
    kl = torch.tensor([[0.5, 1.0, 0.0]])
    advantages = reinforce_pp_advantages(torch.tensor([1.0]), torch.ones(1, 3), kl=kl, kl_coef=0.1)
    # rewards -0.05, -0.1, 0 + 1; returns-to-go 0.85, 0.9, 1.0; then whitened
    returns = torch.tensor([0.85, 0.9, 1.0])
    expected = (returns - returns.mean()) / returns.var(correction=0).sqrt()
    assert_close(advantages, expected[None], atol=1e-5, rtol=1e-5)
    assert advantages[0, 0] < advantages[0, 1] < advantages[0, 2]


def test_reinforce_pp_baseline_centres_each_group_first():
    scores = torch.tensor([[1.0, 3.0], [10.0, 10.0]])
    advantages = reinforce_pp_baseline_advantages(scores, torch.ones(4, 1))
    # centred -1, 1, 0, 0; mean 0, variance (1 + 1) / 4 = 0.5: -1/√0.5 = -√2
    assert_close(advantages, torch.tensor([[-math.sqrt(2)], [math.sqrt(2)], [0.0], [0.0]]))


LOGPROBS = torch.tensor([[-1.0, -2.0], [-3.0, -4.0]])
PG_MASK = torch.tensor([[1, 1], [1, 0]])
PG_ADVANTAGES = torch.tensor([1.0, -2.0])  # per sequence


def test_policy_gradient_loss_token_normalised():
    # -A log π: (1, 2 | -6, pad); every token weighs the same: (1 + 2 - 6) / 3
    assert_close(policy_gradient_loss(LOGPROBS, PG_ADVANTAGES, PG_MASK), torch.tensor(-1.0))


def test_policy_gradient_loss_sequence_normalised():
    # sequence means (1 + 2) / 2 = 1.5 and -6; then (1.5 - 6) / 2
    loss = policy_gradient_loss(LOGPROBS, PG_ADVANTAGES, PG_MASK, normalization="sequence")
    assert_close(loss, torch.tensor(-2.25))


def test_policy_gradient_unknown_normalization():
    with pytest.raises(ValueError, match="valid options: 'token', 'sequence'"):
        policy_gradient_loss(LOGPROBS, PG_ADVANTAGES, PG_MASK, normalization="batch")


def test_reinforce_pp_credits_a_turns_reward_to_its_own_turn_and_the_ones_before():
    # model tokens t0, t1 (turn 1), t2 an observation (masked), t3 (turn 2); turn 1's step rewarded 1.0, the
    # score is 1.0 (nothing after turn 1): rewards (0, 1, -, 0), returns-to-go (1, 1, -, 0); turn 2's token
    # gets none of turn 1's reward (with the score on the last token it would get all of it: (1, 1, -, 1)).
    mask = torch.tensor([[1, 1, 0, 1]])
    turn_rewards = torch.tensor([[0.0, 1.0, 0.0, 0.0]])
    advantages = reinforce_pp_advantages(torch.tensor([1.0]), mask, turn_rewards=turn_rewards)
    # whitened: mean 2/3, variance ((1/3)^2 + (1/3)^2 + (2/3)^2) / 3 = 2/9, std √2/3:
    # (1/3)/(√2/3) = 1/√2, (-2/3)/(√2/3) = -√2
    assert_close(advantages, torch.tensor([[1 / math.sqrt(2), 1 / math.sqrt(2), 0.0, -math.sqrt(2)]]))


def test_reinforce_pp_baseline_takes_the_group_mean_off_the_rest_of_the_score():
    # two episodes of one prompt, 2 tokens each (one per turn), turn 1 rewarded 1.0 and 0.0, scores 3 and 1
    # (mean 2.0), centred 1.0 and -1.0; the rest of each centred score goes on its last token:
    # row 0: t0 1.0, t1 1.0 - 1.0 = 0.0 -> returns (1, 0); row 1: t0 0.0, t1 -1.0 - 0.0 = -1.0 -> (-1, -1)
    mask = torch.ones(2, 2)
    turn_rewards = torch.tensor([[1.0, 0.0], [0.0, 0.0]])
    advantages = reinforce_pp_baseline_advantages(torch.tensor([[3.0, 1.0]]), mask, turn_rewards=turn_rewards)
    # returns (1, 0, -1, -1): mean -1/4, deviations (5/4, 1/4, -3/4, -3/4), variance (25 + 1 + 9 + 9) / 64 =
    # 11/16, std √11/4
    std = math.sqrt(11) / 4
    assert_close(advantages, torch.tensor([[1.25 / std, 0.25 / std], [-0.75 / std, -0.75 / std]]))

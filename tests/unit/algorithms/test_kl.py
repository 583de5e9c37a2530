import math
from typing import get_args

import pytest
import torch
from torch.testing import assert_close

from asyncrlhf.algorithms import AdaptiveKLController, KLKind, kl_penalty, shape_rewards

pytestmark = pytest.mark.unit

LN2 = math.log(2.0)
# column 0: p = 0.5, q = 0.25 (ℓ = ln 2); column 1: p = 0.25, q = 0.5 (ℓ = -ln 2)
LOGP = torch.tensor([[math.log(0.5), math.log(0.25)]])
LOGQ = torch.tensor([[math.log(0.25), math.log(0.5)]])
# JS: m = 0.375; log(0.5 / 0.375) = ln(4/3) > 0, log(0.25 / 0.375) = ln(2/3) < 0 -> ½ ln(4/3) both ways
JS = 0.5 * math.log(4 / 3)
EXPECTED = {
    "kl": [LN2, -LN2],
    "clamped_kl": [LN2, 0.0],
    "bregman": [0.5 - 1 + LN2, 2 - 1 - LN2],  # e^-ℓ - 1 + ℓ
    "squared_error": [0.5 * LN2**2, 0.5 * LN2**2],
    "jensen_shannon": [JS, JS],
}
NONNEGATIVE = ["clamped_kl", "bregman", "squared_error", "jensen_shannon"]


@pytest.mark.parametrize("kind", list(EXPECTED))
def test_hand_computed(kind):
    assert_close(kl_penalty(LOGP, LOGQ, kind), torch.tensor([EXPECTED[kind]]))


def test_every_kind_is_tested():
    assert set(get_args(KLKind)) == set(EXPECTED)


@pytest.mark.parametrize("kind", list(EXPECTED))
def test_zero_where_policy_equals_reference(kind):
    logprobs = -5 * torch.rand(4, 7, generator=torch.Generator().manual_seed(0))
    assert torch.equal(kl_penalty(logprobs, logprobs.clone(), kind), torch.zeros(4, 7))


@pytest.mark.parametrize("kind", NONNEGATIVE)
def test_nonnegative(kind):
    g = torch.Generator().manual_seed(1)
    logprobs, ref = -5 * torch.rand(64, 9, generator=g), -5 * torch.rand(64, 9, generator=g)
    assert (kl_penalty(logprobs, ref, kind) >= 0).all()


def test_k1_is_not_nonnegative():
    assert (kl_penalty(LOGP, LOGQ, "kl") < 0).any()  # unbiased but signed, hence not in NONNEGATIVE


def test_unknown_kind_lists_options():
    with pytest.raises(ValueError, match="valid options: 'kl', 'clamped_kl', 'bregman'"):
        kl_penalty(LOGP, LOGQ, "reverse")


def test_shape_rewards_hand_computed():
    kl = torch.tensor([[0.1, 0.2, 0.3], [0.4, 0.5, 0.6], [0.7, 0.8, 0.9]])
    mask = torch.tensor([[1, 1, 1], [1, 1, 0], [0, 0, 0]])
    rewards = shape_rewards(torch.tensor([1.0, 2.0, 3.0]), kl, mask, kl_coef=0.5)
    expected = torch.tensor([
        [-0.05, -0.1, -0.15 + 1.0],  # -0.5 * kl, score on the last token
        [-0.2, -0.25 + 2.0, 0.0],  # last real token is t=1
        [0.0, 0.0, 0.0],  # no real token: nothing to reward
    ])
    assert_close(rewards, expected)


def test_adaptive_kl_controller():
    controller = AdaptiveKLController(init_kl_coef=0.1, target=6.0, horizon=10000)
    # e = clip((9 - 6) / 6, -0.2, 0.2) = 0.2; β = 0.1 * (1 + 0.2 * 1000 / 10000) = 0.102
    assert controller.update(current_kl=9.0, n_steps=1000) == pytest.approx(0.102)
    # e = (5.4 - 6) / 6 = -0.1; β = 0.102 * (1 - 0.1 * 0.1) = 0.10098
    controller.update(current_kl=5.4, n_steps=1000)
    assert controller.value == pytest.approx(0.10098)


def test_adaptive_kl_controller_rejects_bad_target():
    with pytest.raises(ValueError, match="target > 0"):
        AdaptiveKLController(init_kl_coef=0.1, target=0.0, horizon=10000)


def test_shape_rewards_keeps_per_turn_rewards_at_their_turns():
    # an episode: model turn 1 (t0, t1), the observation (t2, t3: masked), model turn 2 (t4, t5);
    # turn 1's step rewarded 0.5 (at t1); the score 2.0 holds it, so 2.0 - 0.5 = 1.5 goes on the last token
    mask = torch.tensor([[1, 1, 0, 0, 1, 1]])
    kl = torch.full((1, 6), 0.2)
    turn_rewards = torch.tensor([[0.0, 0.5, 0.0, 0.0, 0.0, 0.0]])
    rewards = shape_rewards(torch.tensor([2.0]), kl, mask, kl_coef=0.5, turn_rewards=turn_rewards)
    # -0.5 * 0.2 = -0.1 on each model token; t1: -0.1 + 0.5 = 0.4; t5: -0.1 + 1.5 = 1.4
    assert_close(rewards, torch.tensor([[-0.1, 0.4, 0.0, 0.0, -0.1, 1.4]]))
    # the row still sums to the score less the KL: 2.0 - 4 * 0.1 = 1.6
    assert rewards.sum().item() == pytest.approx(1.6)

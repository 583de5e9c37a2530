"""Equivalences every loss must keep: micro-batching is invisible, padding is invisible."""

import pytest
import torch
from torch.testing import assert_close

from asyncrlhf.algorithms import (
    best_of_n_loss,
    decoupled_ppo_loss,
    grpo_loss,
    importance_weights,
    policy_gradient_loss,
    ppo_policy_loss,
    ppo_value_loss,
)

pytestmark = pytest.mark.unit

B, T = 8, 5
LENGTHS = torch.tensor([5, 1, 3, 2, 4, 5, 2, 1])  # uneven, so per-micro-batch means would differ


def _batch() -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    return {
        "mask": (torch.arange(T) < LENGTHS[:, None]).float(),
        "old": -torch.rand(B, T, generator=g),
        "behaviour": -torch.rand(B, T, generator=g),
        "ref": -torch.rand(B, T, generator=g),
        "advantages": torch.randn(B, T, generator=g),
        "returns": torch.randn(B, T, generator=g),
        "params": -torch.rand(B, T, generator=g),  # log-probs, or values for the value loss
    }


# Each takes (params, batch, denominator) and returns the scalar loss; token-mean unless named otherwise.
def _ppo_policy(p, b, d):
    return ppo_policy_loss(p, b["old"], b["advantages"], b["mask"], 0.2, denominator=d)[0]


def _ppo_value(p, b, d):
    return ppo_value_loss(p, b["old"], b["returns"], b["mask"], 0.2, denominator=d)


def _grpo(p, b, d):
    advantages = b["advantages"][:, 0]  # one per sequence
    loss, _ = grpo_loss(
        p, b["old"], advantages, b["mask"], 0.2, ref_logprobs=b["ref"], kl_coef=0.1, denominator=d
    )
    return loss


def _decoupled_ppo(p, b, d):
    weights = importance_weights(b["old"], b["behaviour"], "tis")
    return decoupled_ppo_loss(p, b["old"], weights, b["advantages"], b["mask"], 0.2, denominator=d)[0]


def _pg_token(p, b, d):
    return policy_gradient_loss(p, b["advantages"], b["mask"], "token", denominator=d)


def _pg_sequence(p, b, d):
    # sequence-level: the step's denominator is its sequence count, B, not its token count
    sequences = None if d is None else B
    return policy_gradient_loss(p, b["advantages"], b["mask"], "sequence", denominator=sequences)


def _best_of_n(p, b, d):
    return best_of_n_loss(p, b["mask"], denominator=d)


LOSSES = {
    "ppo_policy": _ppo_policy,
    "ppo_value": _ppo_value,
    "grpo": _grpo,
    "decoupled_ppo": _decoupled_ppo,
    "pg_token": _pg_token,
    "pg_sequence": _pg_sequence,
    "best_of_n": _best_of_n,
}


def _loss_and_grad(name, batches, denominator):
    params = _batch()["params"].requires_grad_(True)
    loss_fn = LOSSES[name]
    total = sum(loss_fn(params[rows], {k: v[rows] for k, v in b.items()}, denominator) for rows, b in batches)
    total.backward()
    return total.detach(), params.grad


@pytest.mark.parametrize("name", list(LOSSES))
def test_one_batch_of_8_equals_two_of_4_with_global_denominator(name):
    batch = _batch()
    full = [(slice(0, 8), batch)]
    halves = [(slice(0, 4), batch), (slice(4, 8), batch)]
    tokens = batch["mask"].sum()  # 23 real tokens in the whole step
    loss_8, grad_8 = _loss_and_grad(name, full, None)
    loss_2x4, grad_2x4 = _loss_and_grad(name, halves, tokens)
    assert_close(loss_2x4, loss_8)
    assert_close(grad_2x4, grad_8)
    if name != "pg_sequence":  # equal-size halves: a mean of sequence means is already invariant
        # for token-level losses the global denominator is what makes it so: the mean of the means differs
        naive, _ = _loss_and_grad(name, halves, None)
        assert not torch.allclose(naive / 2, loss_8)


@pytest.mark.parametrize("name", list(LOSSES))
def test_padding_gets_zero_gradient(name):
    batch = _batch()
    padding = batch["mask"] == 0
    params = batch["params"].requires_grad_(True)
    LOSSES[name](params, batch, None).backward()
    assert torch.equal(params.grad[padding], torch.zeros(int(padding.sum())))
    assert (params.grad[~padding] != 0).any()


@pytest.mark.parametrize("name", list(LOSSES))
def test_padding_values_do_not_change_the_loss(name):
    batch = _batch()
    padding = batch["mask"] == 0
    loss = LOSSES[name](batch["params"], batch, None)
    # padding filled with NaN and with values whose ratios overflow to inf: neither may leak into the loss
    garbage = {k: torch.where(padding, torch.nan, v) for k, v in batch.items()}
    garbage["params"] = torch.where(padding, 1e4, batch["params"])
    garbage["mask"] = batch["mask"]
    assert_close(LOSSES[name](garbage["params"], garbage, None), loss)

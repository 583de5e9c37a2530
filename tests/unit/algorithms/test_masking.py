import pytest
import torch
from torch.testing import assert_close

from asyncrlhf.algorithms import masked_mean, masked_sum, masked_var, token_mean

pytestmark = pytest.mark.unit

X = torch.tensor([[1.0, 2.0, 3.0], [4.0, 5.0, 6.0]])
MASK = torch.tensor([[1, 1, 0], [1, 0, 0]])  # real values: 1, 2 | 4


def test_masked_sum():
    assert_close(masked_sum(X, MASK), torch.tensor(7.0))  # 1 + 2 + 4
    assert_close(masked_sum(X, MASK, dim=-1), torch.tensor([3.0, 4.0]))  # 1 + 2, 4


def test_masked_mean():
    assert_close(masked_mean(X, MASK), torch.tensor(7.0 / 3))  # (1 + 2 + 4) / 3
    assert_close(masked_mean(X, MASK, dim=-1), torch.tensor([1.5, 4.0]))  # 3 / 2, 4 / 1


def test_masked_mean_of_nothing_is_zero_not_nan():
    assert_close(masked_mean(X, torch.zeros_like(MASK)), torch.tensor(0.0))
    assert_close(masked_mean(X, torch.tensor([[1, 0, 0], [0, 0, 0]]), dim=-1), torch.tensor([1.0, 0.0]))


def test_masked_var_is_population_variance():
    # mean 7/3; deviations -4/3, -1/3, 5/3; squares 16/9 + 1/9 + 25/9 = 42/9; / 3 -> 14/9
    assert_close(masked_var(X, MASK), torch.tensor(14.0 / 9))


def test_token_mean_with_and_without_denominator():
    assert_close(token_mean(X, MASK), torch.tensor(7.0 / 3))
    assert_close(token_mean(X, MASK, denominator=7), torch.tensor(1.0))  # 7 / 7


def test_masked_positions_get_zero_gradient():
    x = X.clone().requires_grad_(True)
    masked_mean(x, MASK).backward()
    assert_close(x.grad, MASK.float() / 3)  # d/dx of (x00 + x01 + x10) / 3

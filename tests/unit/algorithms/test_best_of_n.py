import pytest
import torch
from torch.testing import assert_close

from asyncrlhf.algorithms import best_of_n_loss, best_of_n_select

pytestmark = pytest.mark.unit


def test_select_highest_reward_first_on_ties():
    assert best_of_n_select(torch.tensor([[0.1, 0.7, 0.3], [1.0, 1.0, 0.0]])).tolist() == [1, 0]


def test_loss_is_token_mean_nll():
    token_logps = torch.tensor([[-1.0, -2.0, -9.0], [-0.5, -9.0, -9.0]])
    mask = torch.tensor([[1, 1, 0], [1, 0, 0]])
    assert_close(best_of_n_loss(token_logps, mask), torch.tensor(3.5 / 3))  # (1 + 2 + 0.5) / 3

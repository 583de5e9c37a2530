import math

import pytest
import torch
from torch.testing import assert_close

from asyncrlhf.algorithms import perplexity, sequence_kl, win_rate

pytestmark = pytest.mark.unit


def test_win_rate_counts_ties_half():
    scores = torch.tensor([0.9, 0.1, 0.5, -0.2])
    reference = torch.tensor([0.3, 0.4, 0.5, -0.2])
    # win, loss, tie, tie -> (1 + 0 + 0.5 + 0.5) / 4 = 0.5
    assert_close(win_rate(scores, reference), torch.tensor(0.5, dtype=torch.float64))
    # win, win, win, loss -> 3 / 4
    assert_close(
        win_rate(torch.tensor([1.0, 1.0, 1.0, -1.0]), torch.zeros(4)), torch.tensor(0.75, dtype=torch.float64)
    )


def test_policy_identical_to_reference_has_win_rate_one_half():
    scores = torch.tensor([0.2, -0.7, 0.0, 0.9, 0.9])
    assert float(win_rate(scores, scores.clone())) == 0.5


def test_win_rate_rejects_empty_or_mismatched():
    with pytest.raises(ValueError):
        win_rate(torch.zeros(0), torch.zeros(0))
    with pytest.raises(ValueError):
        win_rate(torch.zeros(2), torch.zeros(3))


def test_sequence_kl_hand_computed():
    policy = torch.tensor([[-1.0, -2.0, -0.5], [-0.1, -0.2, 99.0]])
    reference = torch.tensor([[-1.5, -1.0, -0.5], [-0.3, -0.2, -99.0]])
    mask = torch.tensor([[1, 1, 1], [1, 1, 0]])
    # row 0: (-1 + 1.5) + (-2 + 1) + (-0.5 + 0.5) = 0.5 - 1 + 0 = -0.5
    # row 1: (-0.1 + 0.3) + (-0.2 + 0.2) = 0.2; the padded 99 vs -99 never counts
    assert_close(sequence_kl(policy, reference, mask), torch.tensor([-0.5, 0.2]))


def test_kl_of_the_reference_against_itself_is_zero():
    logps = -torch.rand(3, 5)
    mask = torch.ones(3, 5)
    assert torch.equal(sequence_kl(logps, logps.clone(), mask), torch.zeros(3))


def test_perplexity_hand_computed():
    logps = torch.tensor([[math.log(0.5), math.log(0.5), 0.0], [math.log(0.25), math.log(1.0), 0.0]])
    mask = torch.tensor([[1, 1, 0], [1, 1, 0]])
    # row 0: exp(-(ln .5 + ln .5) / 2) = 1 / 0.5 = 2;  row 1: exp(-(ln .25 + 0) / 2) = sqrt(4) = 2
    assert_close(perplexity(logps, mask), torch.tensor([2.0, 2.0]))
    assert_close(perplexity(torch.zeros(1, 2), torch.zeros(1, 2)), torch.tensor([1.0]))  # no tokens: 1

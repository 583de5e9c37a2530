import pytest
import torch
from torch.testing import assert_close

from asyncrlhf.algorithms import missing_eos_penalty

pytestmark = pytest.mark.unit


def test_missing_eos_gets_fixed_score():
    scores = torch.tensor([0.5, 2.0, -3.0])
    ended = torch.tensor([True, False, False])
    assert_close(missing_eos_penalty(scores, ended), torch.tensor([0.5, -1.0, -1.0]))  # seed default -1
    assert_close(missing_eos_penalty(scores, ended, penalty=-5.0), torch.tensor([0.5, -5.0, -5.0]))

import math

import pytest
import torch
from torch.testing import assert_close

from asyncrlhf.algorithms import sequence_logprobs, token_logprobs

pytestmark = pytest.mark.unit

# token 0: logits (0, ln 2, 0) -> softmax (1/4, 2/4, 1/4); token 1: logits (0, 0, 0) -> 1/3 each
LOGITS = torch.tensor([[[0.0, math.log(2.0), 0.0], [0.0, 0.0, 0.0]]])
LABELS = torch.tensor([[1, 2]])


def test_token_logprobs_hand_computed():
    assert_close(token_logprobs(LOGITS, LABELS), torch.tensor([[math.log(0.5), math.log(1 / 3)]]))


def test_token_logprobs_temperature():
    # T = 2: logits (0, ln 2 / 2, 0) -> exp (1, √2, 1); p(label 1) = √2 / (2 + √2); uniform row unchanged
    expected = torch.tensor([[math.log(math.sqrt(2) / (2 + math.sqrt(2))), math.log(1 / 3)]])
    assert_close(token_logprobs(LOGITS, LABELS, temperature=2.0), expected)


def test_token_logprobs_matches_log_softmax():
    logits = torch.randn(3, 4, 11, generator=torch.Generator().manual_seed(0))
    labels = torch.randint(0, 11, (3, 4), generator=torch.Generator().manual_seed(1))
    expected = torch.log_softmax(logits / 0.7, -1).gather(-1, labels.unsqueeze(-1)).squeeze(-1)
    assert_close(token_logprobs(logits, labels, temperature=0.7), expected)


def test_token_logprobs_rejects_nonpositive_temperature():
    with pytest.raises(ValueError, match="temperature must be > 0"):
        token_logprobs(LOGITS, LABELS, temperature=0.0)


def test_sequence_logprobs_sums_real_tokens():
    token_logps = torch.tensor([[-1.0, -2.0, -3.0], [-0.5, -0.5, -9.0]])
    mask = torch.tensor([[1, 1, 1], [1, 1, 0]])
    # -1 - 2 - 3 = -6; -0.5 - 0.5 = -1 (the -9 is padding)
    assert_close(sequence_logprobs(token_logps, mask), torch.tensor([-6.0, -1.0]))

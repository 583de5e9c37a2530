"""Fixtures: a generator stand-in serving WeightSync, and the learner's model."""

from __future__ import annotations

import pytest
import torch

from tests.integration.weights.helpers import Generator, tiny_model


@pytest.fixture
def generator():
    gen = Generator()
    yield gen
    gen.stop()


@pytest.fixture
def learner() -> torch.nn.Module:
    return tiny_model(seed=0)

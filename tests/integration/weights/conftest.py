"""Fixtures: a generator stand-in serving WeightSync, the learner's model, and the route a push takes."""

from __future__ import annotations

import pytest
import torch

from asyncrlhf.weights.shm import shm_host
from asyncrlhf.weights.vocabulary import Route
from tests.integration.weights.helpers import Generator, tiny_model


@pytest.fixture
def generator():
    gen = Generator()
    yield gen
    gen.stop()


@pytest.fixture
def learner() -> torch.nn.Module:
    return tiny_model(seed=0)


@pytest.fixture(params=[Route.STREAM, Route.DATA, Route.SHM], ids=lambda r: r.value)
def direct_route(request) -> Route:
    """A route the learner pushes over directly (the pusher is given only it and the stream: `ONLY`)."""
    if request.param == Route.SHM and not shm_host():
        pytest.skip("no writable /dev/shm on this machine")
    return request.param

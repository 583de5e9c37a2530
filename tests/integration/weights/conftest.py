"""Fixtures: a generator stand-in serving WeightSync, and the learner's model."""

from __future__ import annotations

import pytest
import torch

from asyncrlhf.weights import pusher as pusher_module
from asyncrlhf.weights.shm import shm_host
from tests.integration.weights import helpers
from tests.integration.weights.helpers import Generator, tiny_model


@pytest.fixture
def generator(request):
    if "data_path" in request.fixturenames:
        request.getfixturevalue("data_path")  # first: it says whether generators offer a data channel
    gen = Generator()
    yield gen
    gen.stop()


@pytest.fixture
def learner() -> torch.nn.Module:
    return tiny_model(seed=0)


@pytest.fixture(params=["stream", "data", "shm"])
def data_path(request, monkeypatch):
    """Run a pusher test over every data path: the gRPC byte stream and the data channel (as across hosts:
    the pusher sees no shared memory; generators offer no data channel, or one) and, where /dev/shm exists,
    the same-host segment."""
    if request.param in ("stream", "data"):
        monkeypatch.setattr(pusher_module, "shm_host", lambda: "")
        monkeypatch.setitem(helpers.DATA_CHANNEL, "on", request.param == "data")
    elif not shm_host():
        pytest.skip("no writable /dev/shm on this machine")
    return request.param

"""Fixtures: a generator stand-in serving WeightSync, and the learner's model."""

from __future__ import annotations

import pytest
import torch

from asyncrlhf.weights import pusher as pusher_module
from asyncrlhf.weights.shm import shm_host
from tests.integration.weights.helpers import Generator, tiny_model


@pytest.fixture
def generator():
    gen = Generator()
    yield gen
    gen.stop()


@pytest.fixture
def learner() -> torch.nn.Module:
    return tiny_model(seed=0)


@pytest.fixture(params=["stream", "shm"])
def data_path(request, monkeypatch):
    """Run a pusher test over both data paths: the byte stream (as across hosts: the pusher sees no shared
    memory) and, where /dev/shm exists, the same-host segment."""
    if request.param == "stream":
        monkeypatch.setattr(pusher_module, "shm_host", lambda: "")
    elif not shm_host():
        pytest.skip("no writable /dev/shm on this machine")
    return request.param

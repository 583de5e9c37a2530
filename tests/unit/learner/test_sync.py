"""The weight publisher's background push, with a stand-in pusher that blocks until released: the snapshot is
taken on the caller's thread (under ZeRO-3 the gathers are collectives: every rank keeps their order), the
push runs on a thread of its own, one at a time, and its failure reaches the caller."""

from __future__ import annotations

import threading
import time
from types import SimpleNamespace

import pytest
import torch

from asyncrlhf.config import load_config
from asyncrlhf.registry import Member
from asyncrlhf.version import PolicyVersion
from services.learner.metrics import LearnerMetrics
from services.learner.sync import PushFailed, WeightPublisher

pytestmark = pytest.mark.unit


class BlockingPusher:
    """Holds every push until `release` is set; records the versions it was given."""

    def __init__(self, fail: bool = False):
        self.release, self.fail = threading.Event(), fail
        self.versions: list[int] = []

    def prepare(self, weights, version: PolicyVersion):
        return version

    def send(self, push: PolicyVersion, targets):
        self.release.wait(timeout=30)
        self.versions.append(push.step)
        if self.fail:
            raise PushFailed("the generator cannot take these weights")
        return []

    def close(self) -> None:
        pass


def publisher(rank: int = 0, fail: bool = False) -> tuple[WeightPublisher, BlockingPusher, torch.nn.Module]:
    cfg = load_config(["configs/tiny.yaml"], [])
    module = torch.nn.Linear(2, 2)
    registry = SimpleNamespace(live=lambda: [Member("g0", "127.0.0.1:1", PolicyVersion(0, 0), time.time())])
    pusher = BlockingPusher(fail)
    pub = WeightPublisher(cfg, SimpleNamespace(module=module), rank, registry if rank == 0 else None,
                          LearnerMetrics(), pusher if rank == 0 else None)
    return pub, pusher, module


def test_a_background_push_returns_at_once_with_the_snapshot_taken():
    pub, pusher, module = publisher()
    waited = pub.publish(2, background=True)
    assert waited < 1.0 and not pub.pushed()  # the push is held: still in flight
    snapshot = pub._weights
    assert snapshot is not None and torch.equal(snapshot["weight"], module.weight.detach())
    with torch.no_grad():  # the next step trains meanwhile: the push's copy does not move
        module.weight.add_(1.0)
    assert not torch.equal(snapshot["weight"], module.weight.detach())
    pusher.release.set()
    pub.wait()
    assert pub.pushed() and pusher.versions == [2]


def test_a_newer_version_waits_for_the_push_in_flight_and_each_version_is_pushed():
    pub, pusher, _ = publisher()
    pub.publish(2, background=True)
    threading.Timer(0.3, pusher.release.set).start()
    waited = pub.publish(3, background=True)  # blocks until version 2's push is done, then snapshots 3
    assert waited >= 0.2 and pusher.versions[0] == 2
    pub.wait()
    assert pusher.versions == [2, 3]


def test_a_failed_background_push_is_raised_on_the_learners_thread():
    pub, pusher, _ = publisher(fail=True)
    pub.publish(2, background=True)
    pusher.release.set()
    with pytest.raises(PushFailed, match="cannot take these weights"):
        pub.wait()
    assert pub.pushed()  # raised once


def test_other_ranks_only_gather_and_start_no_thread():
    pub, _, module = publisher(rank=1)
    assert pub.publish(2, background=True) == pytest.approx(0.0, abs=0.1)
    assert pub._in_flight is None and pub.pushed()
    assert torch.equal(pub._weights["weight"], module.weight.detach())

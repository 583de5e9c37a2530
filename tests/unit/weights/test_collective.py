"""The collective route's bucket plan (tensors packed in order, a larger tensor alone in its bucket) and how
its NCCL groups are built."""

import datetime
import os

import pytest
import torch
from torch.distributed import TCPStore
from torch.distributed import distributed_c10d as c10d

from asyncrlhf.weights.codec import to_wire
from asyncrlhf.weights.collective import NCCL_RAISES, Plan, backends_of, process_group
from asyncrlhf.weights.collective_sender import CollectiveSender

pytestmark = pytest.mark.unit


def wire(*nbytes: int):
    return [to_wire(f"t{i}", torch.zeros(n, dtype=torch.uint8)) for i, n in enumerate(nbytes)]


def test_tensors_fill_buckets_in_order_and_a_larger_one_gets_its_own():
    # bucket 32: 10 + 20 = 30 fit; 30 + 50 > 32, so 50 opens bucket 1 (alone: larger than a bucket);
    # 50 + 5 > 32, so 5 opens bucket 2, and 5 + 20 = 25 fits beside it.
    plan = Plan.of(wire(10, 20, 50, 5, 20), bucket_bytes=32)
    assert plan.sizes == (30, 50, 25)
    assert plan.places == ((0, 0), (0, 10), (1, 0), (2, 0), (2, 5))
    assert [list(plan.members(k)) for k in range(3)] == [[0, 1], [2], [3, 4]]


def test_a_bucket_size_must_be_positive():
    with pytest.raises(ValueError, match="bucket_bytes"):
        CollectiveSender(bucket_bytes=0)


def test_only_a_gpu_offers_nccl():
    assert backends_of("cpu") == ("gloo",)


class RecordedNccl:
    """Stands in for `ProcessGroupNCCL`, which this CPU build of torch lacks: it records the environment its
    constructor saw, where torch's reads TORCH_NCCL_BLOCKING_WAIT and TORCH_NCCL_ASYNC_ERROR_HANDLING for the
    group it builds."""

    class Options:
        _timeout = None

    seen: dict[str, str | None] = {}

    def __init__(self, store, rank, world_size, options):
        RecordedNccl.seen = {name: os.environ.get(name) for name in NCCL_RAISES}
        self.timeout = options._timeout


def test_an_nccl_weight_group_raises_on_a_timeout_instead_of_its_watchdog_ending_the_process(monkeypatch):
    """Built with blocking waits (no watchdog thread; `Work.wait` aborts the communicator and raises) and
    clean-up-only error handling, set for its constructor alone: a user's setting is back after."""
    monkeypatch.setattr(c10d, "ProcessGroupNCCL", RecordedNccl, raising=False)
    monkeypatch.setenv("TORCH_NCCL_ASYNC_ERROR_HANDLING", "3")  # torch's default: tear the process down
    monkeypatch.delenv("TORCH_NCCL_BLOCKING_WAIT", raising=False)
    store = TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
    group = process_group("nccl", store, 0, 2, timeout_s=7.0)
    assert RecordedNccl.seen == {"TORCH_NCCL_BLOCKING_WAIT": "1", "TORCH_NCCL_ASYNC_ERROR_HANDLING": "2"}
    assert group.timeout == datetime.timedelta(seconds=7)
    assert os.environ["TORCH_NCCL_ASYNC_ERROR_HANDLING"] == "3"
    assert "TORCH_NCCL_BLOCKING_WAIT" not in os.environ

"""The collective route's bucket plan: tensors packed in order, a larger tensor alone in its bucket."""

import pytest
import torch

from asyncrlhf.weights.codec import to_wire
from asyncrlhf.weights.collective import Plan, backends_of

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
        Plan.of(wire(1), bucket_bytes=0)


def test_only_a_gpu_offers_nccl():
    assert backends_of("cpu") == ("gloo",)

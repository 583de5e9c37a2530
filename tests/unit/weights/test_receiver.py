"""The receiver fed directly, without a network: staging, the atomic swap, rejections, deltas."""

from __future__ import annotations

import pytest
import torch

from asyncrlhf.version import PolicyVersion
from asyncrlhf.weights.codec import Snapshot, chunks, prepare
from asyncrlhf.weights.delta import DeltaPushes
from asyncrlhf.weights.receiver import WeightReceiver
from asyncrlhf.weights.target import ModuleTarget, swap_in
from asyncrlhf.weights.vocabulary import PushRejected, Reason

pytestmark = pytest.mark.unit


def pushed(tensors, step: int, chunk_bytes: int, lineage: int = 0):
    return chunks(Snapshot(PolicyVersion(lineage, step), prepare(tensors)), chunk_bytes)


def test_receiver_accepts_plain_messages_and_swaps_without_allocating():
    live = torch.nn.Linear(4, 3)
    receiver = WeightReceiver(ModuleTarget(live))
    new = {k: torch.randn_like(v) for k, v in live.state_dict().items()}
    assert receiver.receive(pushed(new, 1, chunk_bytes=8)).snapshot.version == PolicyVersion(0, 1)
    assert all(torch.equal(live.state_dict()[k], new[k]) for k in new)

    def storages() -> set[int]:  # live tensors and staging buffers: the memory a push may use
        tensors = [*live.state_dict().values(), *receiver.buffers.storages()]
        return {t.data_ptr() for t in tensors}

    first = storages()
    assert len(first) == 2 * len(new)  # the staged tensors went live; the old ones are the next staging
    for version in (2, 3):
        newer = {k: v + version for k, v in new.items()}
        receiver.receive(pushed(newer, version, chunk_bytes=8))
        assert all(torch.equal(live.state_dict()[k], newer[k]) for k in new)
        assert storages() == first  # ping-pong between two sets of buffers, nothing allocated


def test_swap_in_adopts_same_dtype_tensors_and_copies_the_rest():
    live = {"a": torch.zeros(4), "b": torch.zeros(4, dtype=torch.bfloat16)}
    live["tied"] = live["a"]  # one storage under two names (tied embeddings): copied, never swapped
    before = {k: v.data_ptr() for k, v in live.items()}
    free = {"c": torch.zeros(2)}
    free_ptr = free["c"].data_ptr()
    replaced = swap_in(free, {"c": torch.ones(2)}, adopt=True)
    assert set(replaced) == {"c"} and replaced["c"].data_ptr() == free_ptr
    assert free["c"].data_ptr() != free_ptr
    replaced = swap_in(live, {"a": torch.ones(4), "b": torch.ones(4), "tied": torch.full((4,), 2.0)},
                       adopt=True)
    assert replaced == {}  # `a`/`tied` share storage, `b` is bf16 live vs fp32 pushed: all copied in place
    assert {k: v.data_ptr() for k, v in live.items()} == before
    assert torch.equal(live["a"], torch.full((4,), 2.0)) and torch.equal(live["b"], torch.ones(4).bfloat16())
    adopted_ptr = free["c"].data_ptr()
    replaced = swap_in(free, {"c": torch.full((2,), 3.0)}, adopt=False)
    assert replaced == {} and free["c"].data_ptr() == adopted_ptr  # not adopting: copied in place
    assert torch.equal(free["c"], torch.full((2,), 3.0))


class RecordingTarget:
    """A `WeightTarget` that records how it was applied (copying, like a backend that never adopts)."""

    def __init__(self, live: dict[str, torch.Tensor]):
        self.live, self.calls = live, []

    def named_tensors(self):
        return self.live

    def apply_weights(self, tensors, version, *, adopt=False):
        self.calls.append((version, adopt, sorted(tensors)))
        swap_in(self.live, tensors, adopt=False)


def test_receiver_applies_with_the_version_it_verified_and_hands_the_tensors_over():
    target = RecordingTarget({"w": torch.zeros(3), "b": torch.zeros(1)})
    receiver = WeightReceiver(target, PolicyVersion(2, 4))
    new = {"w": torch.arange(3.0), "b": torch.ones(1)}
    receiver.receive(pushed(new, 5, chunk_bytes=4, lineage=2))
    assert target.calls == [(PolicyVersion(2, 5), True, ["b", "w"])]
    assert receiver.version == PolicyVersion(2, 5) and torch.equal(target.live["w"], new["w"])
    with pytest.raises(PushRejected, match="stale_version"):
        receiver.receive(pushed(new, 5, chunk_bytes=4, lineage=2))
    assert len(target.calls) == 1  # a rejected push never reaches the target


def test_receiver_rejection_leaves_the_module_untouched():
    live = torch.nn.Linear(4, 3)
    before = {k: v.clone() for k, v in live.state_dict().items()}
    messages = list(pushed({k: torch.randn_like(v) for k, v in before.items()}, 1, chunk_bytes=8))
    with pytest.raises(PushRejected) as err:
        WeightReceiver(ModuleTarget(live)).receive(messages[:-1])
    assert err.value.reason == Reason.TRUNCATED
    assert all(torch.equal(live.state_dict()[k], before[k]) for k in before)


def test_a_push_that_changes_lineage_mid_stream_is_refused():
    receiver = WeightReceiver(RecordingTarget({"w": torch.zeros(3), "b": torch.zeros(1)}))
    push = {"w": torch.arange(3.0), "b": torch.ones(1)}
    first = list(pushed(push, 2, chunk_bytes=4, lineage=1))
    other = list(pushed(push, 2, chunk_bytes=4, lineage=2))
    with pytest.raises(PushRejected, match="changed mid-push"):
        receiver.receive([first[0], *other[1:]])
    assert receiver.version == PolicyVersion(0, 0)


def _delta_push(receiver_step: int, base: dict, new: dict, step: int, corrupt_index: bool = False):
    """`new` as a delta push onto version `receiver_step` (base: its tensors), by the learner's encoder."""
    deltas = DeltaPushes()
    deltas.version(Snapshot(PolicyVersion(0, receiver_step), prepare(base)), ["g"])
    deltas.acknowledged("g", PolicyVersion(0, receiver_step))
    version = deltas.version(Snapshot(PolicyVersion(0, step), prepare(new)), ["g"])
    push = deltas.snapshot(version, "g")
    if corrupt_index:
        t = next(t for t in push.tensors if t.delta is not None and t.delta.elements)
        t.tensor[:4].view(torch.int32)[0] = 1 << 30  # the first index, far outside the tensor
    return chunks(push, 8)


def test_a_delta_lands_onto_the_kept_base_and_a_bad_one_is_refused_keeping_the_version():
    live = torch.nn.Linear(64, 8)
    receiver = WeightReceiver(ModuleTarget(live))
    v1 = {k: torch.randn_like(v) for k, v in live.state_dict().items()}
    v2 = {k: v.clone() for k, v in v1.items()}
    v2["weight"][0, :3] += 1.0
    with pytest.raises(PushRejected, match="delta_base.*holds no base"):  # nothing kept yet
        receiver.receive(_delta_push(0, v1, v2, 1))

    first = DeltaPushes().version(Snapshot(PolicyVersion(0, 1), prepare(v1)), ["g"]).full  # keep_base
    receiver.receive(chunks(first, 8))
    with pytest.raises(PushRejected) as refused:
        receiver.receive(_delta_push(1, v1, v2, 2, corrupt_index=True))
    assert refused.value.reason == Reason.BAD_OFFSET
    assert receiver.version == PolicyVersion(0, 1) and torch.equal(live.weight, v1["weight"])
    receiver.receive(_delta_push(1, v1, v2, 2))
    assert all(torch.equal(live.state_dict()[k], v2[k]) for k in v2)
    with pytest.raises(PushRejected, match="delta_base.*holds the base of"):  # onto 1, serving 2
        receiver.receive(_delta_push(1, v1, v2, 3))


def test_a_delta_naming_more_elements_than_its_tensor_is_refused_before_staging():
    live = torch.nn.Linear(4, 2)
    receiver = WeightReceiver(ModuleTarget(live))
    v1 = {k: torch.randn_like(v) for k, v in live.state_dict().items()}
    receiver.receive(chunks(DeltaPushes().version(Snapshot(PolicyVersion(0, 1), prepare(v1)), ["g"]).full, 8))
    header = next(iter(chunks(Snapshot(PolicyVersion(0, 2), prepare(v1)), 1024)))
    header.delta.elements, header.delta.base_version = 1 << 40, 1
    with pytest.raises(PushRejected, match="bad_offset.*more than the tensor has"):
        receiver.receive([header])
    assert receiver.version == PolicyVersion(0, 1)

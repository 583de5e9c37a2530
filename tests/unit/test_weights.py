"""Weight chunking without a network: the chunk codec, chunk layout, and the receiver fed directly."""

from __future__ import annotations

import time

import pytest
import torch

from asyncrlhf._proto import weights_pb2 as pb
from asyncrlhf.weights import (
    ModuleTarget,
    PushRejected,
    WeightReceiver,
    adapter_tensors,
    chunks,
    decode_chunk,
    encode_chunk,
    prefetched,
    prepare,
    swap_in,
)

pytestmark = pytest.mark.unit


def test_encoded_chunk_is_a_standard_weight_chunk():
    header = pb.WeightChunk(version=3, name="w", dtype=pb.DTYPE_FLOAT32, shape=[2, 2], offset=8, checksum=7)
    raw = encode_chunk(header, memoryview(b"\x01\x02\x03"))
    parsed = pb.WeightChunk.FromString(raw)
    assert parsed.data == b"\x01\x02\x03" and parsed.name == "w" and list(parsed.shape) == [2, 2]


def test_decode_reads_data_wherever_it_is_and_leaves_it_out_of_the_header():
    # protobuf fields may come in any order: put `data` first, as another client might
    data_first = pb.WeightChunk(data=b"xyz").SerializeToString()
    raw = data_first + pb.WeightChunk(version=5, name="w").SerializeToString()
    header, data = decode_chunk(raw)
    assert bytes(data) == b"xyz"
    assert (header.version, header.name, header.data) == (5, "w", b"")


def test_decode_rejects_a_truncated_message():
    raw = encode_chunk(pb.WeightChunk(name="w"), b"0123456789")
    with pytest.raises(ValueError, match="truncated"):
        decode_chunk(raw[:-3])


def test_chunks_split_each_tensor_and_end_with_a_commit():
    state = {"a": torch.zeros(10), "b": torch.zeros(3, dtype=torch.int64), "empty": torch.zeros(0)}
    messages = list(chunks(prepare(state), version=2, chunk_bytes=16))
    # a: 40 bytes -> 16 + 16 + 8; b: 24 bytes -> 16 + 8; empty: one chunk of 0 bytes; then the commit
    assert [(m.name, m.offset, len(m.data)) for m in messages[:-1]] == [
        ("a", 0, 16), ("a", 16, 16), ("a", 32, 8), ("b", 0, 16), ("b", 16, 8), ("empty", 0, 0)]
    assert [m.checksum != 0 for m in messages[:3]] == [False, False, True]  # checksum on the last chunk only
    assert messages[-1].commit and messages[-1].tensor_count == 3 and messages[-1].version == 2
    assert messages[3].dtype == pb.DTYPE_INT64


def test_prepare_casts_floating_tensors_only():
    wire = prepare({"w": torch.ones(2), "ids": torch.arange(2)}, dtype="bfloat16")
    assert [t.dtype for t in wire] == [pb.DTYPE_BFLOAT16, pb.DTYPE_INT64]
    assert wire[0].data.nbytes == 4


def test_prepare_refuses_an_unsupported_dtype():
    with pytest.raises(ValueError, match="cannot push tensor `c`"):
        prepare({"c": torch.zeros(2, dtype=torch.complex64)})


def test_adapter_tensors_keeps_only_lora_weights():
    names = ["q.weight", "q.lora_A.default.weight", "q.lora_B.default.weight"]
    state = {name: torch.zeros(1) for name in names}
    assert list(adapter_tensors(state)) == ["q.lora_A.default.weight", "q.lora_B.default.weight"]


def test_receiver_accepts_plain_messages_and_swaps_without_allocating():
    live = torch.nn.Linear(4, 3)
    receiver = WeightReceiver(ModuleTarget(live))
    new = {k: torch.randn_like(v) for k, v in live.state_dict().items()}
    assert receiver.receive(chunks(prepare(new), 1, chunk_bytes=8)).version == 1
    assert all(torch.equal(live.state_dict()[k], new[k]) for k in new)

    def storages() -> set[int]:  # live tensors and staging buffers: the memory a push may use
        tensors = [*live.state_dict().values(), *receiver._buffers.values()]
        return {t.data_ptr() for t in tensors}

    first = storages()
    assert len(first) == 2 * len(new)  # the staged tensors went live; the old ones are the next staging
    for version in (2, 3):
        newer = {k: v + version for k, v in new.items()}
        receiver.receive(chunks(prepare(newer), version, chunk_bytes=8))
        assert all(torch.equal(live.state_dict()[k], newer[k]) for k in new)
        assert storages() == first  # ping-pong between two sets of buffers, nothing allocated


def test_swap_in_adopts_same_dtype_tensors_and_copies_the_rest():
    live = {"a": torch.zeros(4), "b": torch.zeros(4, dtype=torch.bfloat16)}
    live["tied"] = live["a"]  # one storage under two names (tied embeddings): copied, never swapped
    before = {k: v.data_ptr() for k, v in live.items()}
    free = {"c": torch.zeros(2)}
    free_ptr = free["c"].data_ptr()
    replaced = swap_in(free, {"c": torch.ones(2)})
    assert set(replaced) == {"c"} and replaced["c"].data_ptr() == free_ptr
    assert free["c"].data_ptr() != free_ptr
    replaced = swap_in(live, {"a": torch.ones(4), "b": torch.ones(4), "tied": torch.full((4,), 2.0)})
    assert replaced == {}  # `a`/`tied` share storage, `b` is bf16 live vs fp32 pushed: all copied in place
    assert {k: v.data_ptr() for k, v in live.items()} == before
    assert torch.equal(live["a"], torch.full((4,), 2.0)) and torch.equal(live["b"], torch.ones(4).bfloat16())


def test_receiver_rejection_leaves_the_module_untouched():
    live = torch.nn.Linear(4, 3)
    before = {k: v.clone() for k, v in live.state_dict().items()}
    messages = list(chunks(prepare({k: torch.randn_like(v) for k, v in before.items()}), 1, chunk_bytes=8))
    with pytest.raises(PushRejected) as err:
        WeightReceiver(ModuleTarget(live)).receive(messages[:-1])
    assert err.value.reason == "truncated"
    assert all(torch.equal(live.state_dict()[k], before[k]) for k in before)


def test_prefetched_keeps_order_raises_source_errors_and_stops_when_closed():
    assert list(prefetched(iter([b"a", b"b", b"c"]))) == [b"a", b"b", b"c"]

    def failing():
        yield b"a"
        raise ValueError("encoder broke")

    it = prefetched(failing())
    assert next(it) == b"a"
    with pytest.raises(ValueError, match="encoder broke"):
        next(it)

    produced = []

    def endless():
        while True:
            produced.append(1)
            yield b"x"

    it = prefetched(endless(), depth=2)
    next(it)
    it.close()  # what gRPC does to a cancelled call's request iterator
    time.sleep(0.3)
    settled = len(produced)
    time.sleep(0.3)
    assert len(produced) == settled <= 5  # the producer stopped, a few items ahead at most

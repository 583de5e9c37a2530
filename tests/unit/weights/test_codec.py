"""The wire format without a network: chunk encoding and decoding, chunk layout, dtypes."""

from __future__ import annotations

import numpy as np
import pytest
import torch
import xxhash

from asyncrlhf._proto import weights_pb2 as pb
from asyncrlhf.version import PolicyVersion
from asyncrlhf.weights.codec import (
    HASH_BLOCK,
    Snapshot,
    adapter_tensors,
    chunks,
    copy_hashed,
    decode_chunk,
    encode_chunk,
    prepare,
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
    messages = list(chunks(Snapshot(PolicyVersion(1, 2), prepare(state)), chunk_bytes=16))
    # a: 40 bytes -> 16 + 16 + 8; b: 24 bytes -> 16 + 8; empty: one chunk of 0 bytes; then the commit
    assert [(m.name, m.offset, len(m.data)) for m in messages[:-1]] == [
        ("a", 0, 16), ("a", 16, 16), ("a", 32, 8), ("b", 0, 16), ("b", 16, 8), ("empty", 0, 0)]
    assert [m.checksum != 0 for m in messages[:3]] == [False, False, True]  # checksum on the last chunk only
    assert messages[-1].commit and messages[-1].tensor_count == 3
    first, commit = messages[0], messages[-1]
    assert (commit.version, commit.lineage) == (2, 1) == (first.version, first.lineage)
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


@pytest.mark.parametrize("nbytes", [0, 1, HASH_BLOCK - 1, HASH_BLOCK, 3 * HASH_BLOCK + 17])
def test_copy_hashed_copies_every_byte_and_hashes_them_as_one_stream(nbytes):
    src = np.random.default_rng(nbytes).integers(0, 256, nbytes, dtype=np.uint8)
    dst = np.zeros(nbytes, dtype=np.uint8)
    digest = xxhash.xxh3_64()
    copy_hashed(dst, memoryview(src.tobytes()), digest)
    assert np.array_equal(dst, src)
    assert digest.intdigest() == xxhash.xxh3_64_intdigest(src.tobytes())  # the blocks add up to one hash

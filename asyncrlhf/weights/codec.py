"""The WeightSync wire format: tensors <-> WeightChunk bytes, their dtypes and their checksums.

A push is each tensor in `chunk_bytes` slices (its XXH3-64 checksum on the last slice), then one commit
message. Tensor bytes are the bulk of a push, so they are never copied through protobuf objects:
`encode_chunk` writes a WeightChunk as its small header message followed by the `data` field, and
`decode_chunk` reads the header with protobuf and hands `data` back as a view of the received buffer. The
bytes on the wire are a standard WeightChunk; any protobuf client or server interoperates.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch
import xxhash

from asyncrlhf._proto import weights_pb2 as pb
from asyncrlhf.version import PolicyVersion
from asyncrlhf.weights.vocabulary import PushRejected, Reason

MAX_MESSAGE_BYTES = 64 << 20  # the largest chunk a server accepts; push_chunk_bytes must stay below

TO_WIRE: dict[torch.dtype, pb.DType] = {
    torch.float32: pb.DTYPE_FLOAT32,
    torch.bfloat16: pb.DTYPE_BFLOAT16,
    torch.float16: pb.DTYPE_FLOAT16,
    torch.int64: pb.DTYPE_INT64,
    torch.int32: pb.DTYPE_INT32,
    torch.uint8: pb.DTYPE_UINT8,
    torch.bool: pb.DTYPE_BOOL,
}
FROM_WIRE: dict[pb.DType, torch.dtype] = {v: k for k, v in TO_WIRE.items()}
PUSH_DTYPES: dict[str, torch.dtype] = {
    "float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16,
}


@dataclass(frozen=True)
class WireTensor:
    """A tensor ready to send: cast, contiguous, on CPU, as raw bytes. Shared by every target of a push."""

    name: str
    dtype: pb.DType
    shape: tuple[int, ...]
    data: memoryview  # raw bytes, C order
    tensor: torch.Tensor  # keeps `data` alive
    checksum: int | None = None  # XXH3-64 of `data` if known (a relay forwards it): sent, not recomputed
    # `data` is a delta (`delta.encode`: indices, then values) of this many elements onto a base version;
    # `checksum` (always set then) is the resulting tensor's
    delta: pb.TensorDelta | None = None


def to_wire(name: str, tensor: torch.Tensor, cast: torch.dtype | None = None) -> WireTensor:
    """Prepare one tensor: floating tensors are cast to `cast` (if given), others are sent as they are."""
    t = tensor.detach()
    if cast is not None and t.is_floating_point():
        t = t.to(cast)
    t = t.to("cpu").contiguous()
    if t.dtype not in TO_WIRE:
        supported = sorted(map(str, TO_WIRE))
        raise ValueError(f"cannot push tensor `{name}` of dtype {t.dtype}; supported: {supported}")
    # numpy's stub lacks __buffer__ on ndarray for this Python; an ndarray is a buffer
    data = memoryview(t.reshape(-1).view(torch.uint8).numpy())  # type: ignore[arg-type]
    return WireTensor(name, TO_WIRE[t.dtype], tuple(t.shape), data, t)


def prepare(
    state_dict: Mapping[str, torch.Tensor], dtype: str | torch.dtype | None = None
) -> list[WireTensor]:
    """Every tensor of `state_dict` ready to send, floating ones cast to `dtype` ("bfloat16", ...)."""
    cast = PUSH_DTYPES[dtype] if isinstance(dtype, str) else dtype
    return [to_wire(name, tensor, cast) for name, tensor in state_dict.items()]


@dataclass(frozen=True)
class Snapshot:
    """One version's tensors as pushed: what every route carries, and what a relay forwards. `partial`: the
    tensors cover only some of the live ones (LoRA adapters); `keep_base`: the receiver keeps the version as
    the base of a later delta push (`weights/deltas.py`)."""

    version: PolicyVersion
    tensors: Sequence[WireTensor]
    partial: bool = False
    keep_base: bool = False


def snapshot(state_dict: Mapping[str, torch.Tensor], version: PolicyVersion, dtype: str | None = None,
             partial: bool = False) -> Snapshot:
    """`state_dict` prepared (`prepare`) as `version`."""
    return Snapshot(version, prepare(state_dict, dtype), partial)


def tensor_header(version: PolicyVersion, t: WireTensor, **fields) -> pb.WeightChunk:
    """The message that names tensor `t` of a push of `version` (its bytes, or where they lie: `fields`)."""
    dtype: Any = t.dtype  # a pb.DType value
    return pb.WeightChunk(version=version.step, lineage=version.lineage, name=t.name, dtype=dtype,
                          shape=t.shape, delta=t.delta, **fields)


def version_of(header: pb.WeightChunk) -> PolicyVersion:
    return PolicyVersion(header.lineage, header.version)


def nbytes_of(header: pb.WeightChunk) -> int:
    """The bytes a tensor message carries in all: the whole tensor's, by its shape and dtype, or its delta's
    (0 for an unknown dtype)."""
    dtype = FROM_WIRE.get(header.dtype)
    count = dtype.itemsize if dtype is not None else 0
    if header.HasField("delta"):
        return (count + DELTA_INDEX_BYTES) * header.delta.elements if count else 0
    for d in header.shape:
        count *= d
    return count


DELTA_INDEX_BYTES = 4  # a delta's indices are int32


def adapter_tensors(state_dict: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Only the LoRA adapter tensors (PEFT names contain `lora_`): what a LoRA run pushes."""
    return {name: t for name, t in state_dict.items() if "lora_" in name}


def verify(name: str, filled: int, nbytes: int, digest: xxhash.xxh3_64, checksum: int | None) -> None:
    """A staged tensor's bytes, all `nbytes` of them, hash to the `checksum` they came with."""
    if filled != nbytes or checksum is None:
        raise PushRejected(Reason.TRUNCATED, f"`{name}`: got {filled} of {nbytes} bytes")
    got = digest.intdigest()
    if got != checksum:
        raise PushRejected(Reason.BAD_CHECKSUM, f"`{name}`: XXH3-64 {got:#018x}, expected {checksum:#018x}")


HASH_BLOCK = 256 << 10  # copied then hashed while still in cache: one pass over memory, not two


def copy_hashed(dst: np.ndarray, src: memoryview | bytes, digest: xxhash.xxh3_64) -> None:
    """dst[:] = src, with `digest` updated over the bytes as written to `dst` (so what is verified is what
    was stored, even if `src` changes meanwhile), block by block while each block is in cache: one pass over
    memory rather than two (docs/weights.md). `dst`: a uint8 array of len(src) bytes."""
    written = memoryview(dst)  # type: ignore[arg-type]  # numpy's stub: an ndarray is a buffer
    source = np.frombuffer(src, dtype=np.uint8)
    for start in range(0, len(source), HASH_BLOCK):
        end = start + HASH_BLOCK
        dst[start:end] = source[start:end]
        digest.update(written[start:end])


def encoded_chunks(push: Snapshot, chunk_bytes: int) -> Iterator[bytes]:
    """The serialized tensor messages of one push: each tensor in `chunk_bytes` slices (the commit, each
    target's own, follows: `commit_message`). Each tensor's checksum is computed while its slices are encoded
    (one pass over the bytes, each slice hashed while it is in cache) and sent on its last slice; a tensor
    whose checksum is known already (a relay forwarding what it verified) sends that one, so its receivers
    check the learner's checksum."""
    if not 0 < chunk_bytes <= MAX_MESSAGE_BYTES:
        raise ValueError(f"chunk_bytes must be in (0, {MAX_MESSAGE_BYTES}], got {chunk_bytes}")
    for t in push.tensors:
        nbytes = t.data.nbytes
        digest = xxhash.xxh3_64() if t.checksum is None else None
        for offset in range(0, max(nbytes, 1), chunk_bytes):
            piece = t.data[offset:offset + chunk_bytes]
            if digest is not None:
                digest.update(piece)
            last = offset + chunk_bytes >= nbytes
            checksum = (t.checksum if digest is None else digest.intdigest()) if last else 0
            header = tensor_header(push.version, t, offset=offset, checksum=checksum)
            yield encode_chunk(header, piece)


def commit_message(push: Snapshot, relay: Sequence[tuple[str, str]] = (), relay_fanout: int = 0,
                   ) -> pb.WeightChunk:
    """The final message of a push; `relay`: the (id, address) of the generators the receiver forwards the
    version to once it is committed, `relay_fanout` at a time (`relay.py`)."""
    return pb.WeightChunk(
        version=push.version.step, lineage=push.version.lineage, commit=True, tensor_count=len(push.tensors),
        partial=push.partial, keep_base=push.keep_base,
        relay_targets=[pb.RelayTarget(id=i, address=a) for i, a in relay],
        relay_fanout=relay_fanout if relay else 0)


def chunks(push: Snapshot, chunk_bytes: int) -> Iterator[pb.WeightChunk]:
    """The same push as WeightChunk messages, its commit last (for inspection and tests; the pusher sends
    `encoded_chunks`)."""
    yield from (pb.WeightChunk.FromString(r) for r in encoded_chunks(push, chunk_bytes))
    yield commit_message(push)


_DATA_FIELD = pb.WeightChunk.DESCRIPTOR.fields_by_name["data"].number
_DATA_TAG = bytes([_DATA_FIELD << 3 | 2])  # field 6, length-delimited


def encode_chunk(header: pb.WeightChunk, data: memoryview | bytes) -> bytes:
    """Serialize `header` with `data` as its `data` field, copying the bytes once."""
    return b"".join((header.SerializeToString(), _DATA_TAG, _varint(len(data)), data))


def decode_chunk(raw: bytes) -> tuple[pb.WeightChunk, memoryview]:
    """Parse a serialized WeightChunk into its header (everything but `data`) and a view of `data`."""
    view, pos, data, rest = memoryview(raw), 0, memoryview(b""), []
    while pos < len(raw):
        start: int | None = pos  # None for the data field, which is not part of the header
        key, pos = _read_varint(raw, pos)
        field, wire_type = key >> 3, key & 7
        if wire_type == 0:
            _, pos = _read_varint(raw, pos)
        elif wire_type == 1:
            pos += 8
        elif wire_type == 5:
            pos += 4
        elif wire_type == 2:
            length, pos = _read_varint(raw, pos)
            if field == _DATA_FIELD:
                data, start = view[pos:pos + length], None
            pos += length
        else:
            raise ValueError(f"WeightChunk: unsupported wire type {wire_type}")
        if pos > len(raw):
            raise ValueError("WeightChunk: truncated message")
        if start is not None:
            rest.append(view[start:pos])
    return pb.WeightChunk.FromString(b"".join(rest)), data


def _varint(value: int) -> bytes:
    out = bytearray()
    while value >= 0x80:
        out.append(value & 0x7F | 0x80)
        value >>= 7
    out.append(value)
    return bytes(out)


def _read_varint(raw: bytes, pos: int) -> tuple[int, int]:
    value = shift = 0
    while True:
        if pos >= len(raw) or shift > 63:
            raise ValueError("WeightChunk: malformed varint")
        byte = raw[pos]
        value |= (byte & 0x7F) << shift
        pos, shift = pos + 1, shift + 7
        if byte < 0x80:
            return value, pos

"""A push's tensors, staged and verified one by one for `WeightReceiver`: copied from the byte stream into the
receiver's buffers (`Staging`), or verified where they lie in a same-host segment (`InPlace`); and the one
exception every refusal raises (`PushRejected`, with its `Reason`).
"""

from __future__ import annotations

from concurrent.futures import Future, ThreadPoolExecutor
from typing import TYPE_CHECKING, Literal, TypeAlias

import torch
import xxhash

from asyncrlhf._proto import weights_pb2 as pb
from asyncrlhf.weights.codec import FROM_WIRE, TO_WIRE, WireTensor, copy_hashed

if TYPE_CHECKING:
    from asyncrlhf.weights.channel import Incoming
    from asyncrlhf.weights.shm_read import Lease

# A message's tensor bytes: a view of them (byte stream, segment), or the push's data connection they come on.
ChunkData: TypeAlias = "memoryview | Incoming"

Reason = Literal[
    "unauthenticated", "stale_version", "unknown_tensor", "shape_mismatch", "dtype_mismatch", "bad_offset",
    "duplicate_tensor", "bad_checksum", "truncated", "tensor_count", "missing_tensors", "stale_lineage",
    "shm_unavailable", "channel_unavailable",
]


class PushRejected(Exception):
    """A push the receiver refuses; nothing live was changed."""

    def __init__(self, reason: Reason, message: str):
        super().__init__(f"{reason}: {message}")
        self.reason = reason


class Staging:
    """One tensor being received: a byte buffer filled in order, with a running checksum. Offsets are
    checked at once; the copy and the checksum run on `worker` (one thread, so in order) while the gRPC
    thread waits for the next chunk. `wait` before reading the buffer or reusing it. A tensor of a
    data-channel push is one message whose bytes come from the push's connection (`channel.Incoming`),
    read on `worker` straight into the buffer."""

    def __init__(self, header: pb.WeightChunk, buffer: torch.Tensor, worker: ThreadPoolExecutor):
        self.name, self.dtype, self.shape = header.name, FROM_WIRE[header.dtype], tuple(header.shape)
        self.buffer, self._view, self._worker = buffer, buffer.numpy(), worker
        self.nbytes, self.filled, self.digest = buffer.numel(), 0, xxhash.xxh3_64()
        self.checksum: int | None = None
        self._pending: Future | None = None
        self._incoming: Incoming | None = None

    def add(self, header: pb.WeightChunk, data: ChunkData) -> None:
        if not isinstance(data, memoryview):
            if self.filled:
                raise PushRejected("bad_offset", f"`{self.name}`: a data-channel tensor is one control "
                                                 "message")
            self._incoming = data
            self._pending = self._worker.submit(self._receive, data)
            self.filled = self.nbytes
            return
        end = self.filled + len(data)
        if header.offset != self.filled or end > self.nbytes:
            where = f"chunk at byte {header.offset} (+{len(data)}) after {self.filled} of {self.nbytes} bytes"
            raise PushRejected("bad_offset", f"`{self.name}`: {where}; send chunks in order")
        self._pending = self._worker.submit(self._absorb, self.filled, end, data)
        self.filled = end
        if end == self.nbytes:
            self.checksum = header.checksum

    def _absorb(self, start: int, end: int, data: memoryview) -> None:
        copy_hashed(self._view[start:end], data, self.digest)

    def _receive(self, incoming: Incoming) -> None:
        written = memoryview(self._view)  # type: ignore[arg-type]  # numpy's stub: an ndarray is a buffer
        self.checksum = incoming.receive_into(written, self.digest, self.name)

    def wait(self) -> None:
        if self._pending is not None:
            self._pending.result()

    def abort(self) -> None:
        """The push is refused: stop a read from the data channel (`wait` then returns soon)."""
        if self._incoming is not None:
            self._incoming.abort()

    def wire(self) -> WireTensor:
        """The verified tensor as it came over the wire, with its checksum (after `finish`)."""
        data = memoryview(self._view)  # type: ignore[arg-type]  # numpy's stub: an ndarray is a buffer
        return WireTensor(self.name, TO_WIRE[self.dtype], self.shape, data, self.buffer, self.checksum)

    def finish(self) -> torch.Tensor:
        self.wait()
        _verify(self.name, self.filled, self.nbytes, self.digest, self.checksum)
        return self.buffer.view(self.dtype).reshape(self.shape)


def _verify(name: str, filled: int, nbytes: int, digest: xxhash.xxh3_64, checksum: int | None) -> None:
    if filled != nbytes or checksum is None:
        raise PushRejected("truncated", f"`{name}`: got {filled} of {nbytes} bytes")
    got = digest.intdigest()
    if got != checksum:
        raise PushRejected("bad_checksum", f"`{name}`: XXH3-64 {got:#018x}, expected {checksum:#018x}")


class InPlace:
    """One tensor of a same-host push, verified where it lies: a view of its bytes in the pusher's segment,
    read-locked (`shm_read.Lease`: the pusher cannot rewrite them while this receiver holds the lease), its
    pages mapped in and hashed on `worker`. The staged tensor is that view: no copy. `Staging`'s interface.
    Read through a mapping kept from an earlier version, bytes that fail the checksum are read once more
    through a fresh mapping (a page of the kept one may hold this process's own write)."""

    def __init__(self, header: pb.WeightChunk, nbytes: int, lease: Lease, worker: ThreadPoolExecutor):
        self.name, self.dtype, self.shape = header.name, FROM_WIRE[header.dtype], tuple(header.shape)
        self.nbytes, self.lease, self._worker = nbytes, lease, worker
        self.filled, self.digest = 0, xxhash.xxh3_64()
        self.checksum: int | None = None
        self._data = memoryview(b"")
        self._pending: Future | None = None

    def add(self, header: pb.WeightChunk, data: ChunkData) -> None:
        if self.filled or not isinstance(data, memoryview) or len(data) != self.nbytes:
            raise PushRejected("bad_offset", f"`{self.name}`: a same-host tensor is one control message "
                                             f"naming all its {self.nbytes} bytes")
        self._data, self.filled, self.checksum = data, len(data), header.checksum
        self._pending = self._worker.submit(self._hash, header.shm_offset)

    def _hash(self, start: int) -> None:
        self.lease.populate(start, len(self._data))
        self.digest.update(self._data)
        if self.lease.reused and self.digest.intdigest() != self.checksum:
            self._data = self.lease.refreshed(start, len(self._data))
            self.digest = xxhash.xxh3_64(self._data)

    def wait(self) -> None:
        if self._pending is not None:
            self._pending.result()

    def abort(self) -> None:
        """Nothing to stop: the hash reads a segment, which is there."""

    def tensor(self) -> torch.Tensor:
        if not self.nbytes:
            return torch.empty(self.shape, dtype=self.dtype)
        return torch.frombuffer(self._data, dtype=torch.uint8).view(self.dtype).reshape(self.shape)

    def wire(self) -> WireTensor:
        tensor = self.tensor()
        return WireTensor(self.name, TO_WIRE[self.dtype], self.shape, self._data, tensor, self.checksum)

    def finish(self) -> torch.Tensor:
        self.wait()
        _verify(self.name, self.filled, self.nbytes, self.digest, self.checksum)
        return self.tensor()

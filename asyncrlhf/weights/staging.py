"""A push's tensors, staged and verified one by one for `WeightReceiver`: copied from wherever their route put
them into the receiver's buffers (`Staging`), or verified where they lie (`InPlace`: a same-host segment).
Both read bytes only through a route's `Payload`.
"""

from __future__ import annotations

from concurrent.futures import Future, ThreadPoolExecutor

import torch
import xxhash

from asyncrlhf._proto import weights_pb2 as pb
from asyncrlhf.weights.codec import FROM_WIRE, TO_WIRE, WireTensor
from asyncrlhf.weights.routes import Holder, InPlaceBytes, Lease, Payload
from asyncrlhf.weights.vocabulary import PushRejected, Reason


class Staging:
    """One tensor being received: a byte buffer filled in order, with a running checksum. Offsets are
    checked at once; the copy and the checksum run on `worker` (one thread, so in order) while the gRPC
    thread waits for the next message. `wait` before reading the buffer or reusing it."""

    def __init__(self, header: pb.WeightChunk, buffer: torch.Tensor, worker: ThreadPoolExecutor):
        self.name, self.dtype, self.shape = header.name, FROM_WIRE[header.dtype], tuple(header.shape)
        self.buffer, self._view, self._worker = buffer, buffer.numpy(), worker
        self.nbytes, self.filled, self.digest = buffer.numel(), 0, xxhash.xxh3_64()
        self.checksum: int | None = None
        self.lease: Lease | None = None  # the bytes are the receiver's own
        self._pending: Future | None = None
        self._payload: Payload | None = None

    def add(self, header: pb.WeightChunk, payload: Payload) -> None:
        end = self.filled + payload.nbytes
        if header.offset != self.filled or end > self.nbytes:
            where = (f"bytes at {header.offset} (+{payload.nbytes}) after {self.filled} of {self.nbytes} "
                     "bytes")
            raise PushRejected(Reason.BAD_OFFSET, f"`{self.name}`: {where}; send a tensor's bytes in order")
        if end == self.nbytes:
            self.checksum = header.checksum  # unless the payload carries its own
        self._payload = payload
        self._pending = self._worker.submit(self._absorb, self.filled, end, payload)
        self.filled = end

    def _absorb(self, start: int, end: int, payload: Payload) -> None:
        carried = payload.copy_into(self._view[start:end], self.digest)
        if carried is not None:
            self.checksum = carried

    def wait(self) -> None:
        if self._pending is not None:
            self._pending.result()

    def abort(self) -> None:
        """The push is refused: stop a copy in progress (`wait` then returns soon)."""
        if self._payload is not None:
            self._payload.abort()

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
        raise PushRejected(Reason.TRUNCATED, f"`{name}`: got {filled} of {nbytes} bytes")
    got = digest.intdigest()
    if got != checksum:
        raise PushRejected(Reason.BAD_CHECKSUM, f"`{name}`: XXH3-64 {got:#018x}, expected {checksum:#018x}")


class InPlace:
    """One tensor verified where it lies: a view of its bytes (in a same-host segment, read-locked by its
    `Lease`: the pusher cannot rewrite them while this receiver holds it), its pages mapped in and hashed on
    `worker`. The staged tensor is that view: no copy. `Staging`'s interface. Read through a mapping kept
    from an earlier version, bytes that fail the checksum are read once more through a fresh mapping (a page
    of the kept one may hold this process's own write)."""

    def __init__(self, header: pb.WeightChunk, nbytes: int, lent: InPlaceBytes, worker: ThreadPoolExecutor):
        self.name, self.dtype, self.shape = header.name, FROM_WIRE[header.dtype], tuple(header.shape)
        self.nbytes, self._worker = nbytes, worker
        self.lease: Lease = lent.lease  # held while live tensors view the bytes
        self.filled, self.digest = 0, xxhash.xxh3_64()
        self.checksum: int | None = None
        self._data, self._start = lent.view, lent.start
        self._pending: Future | None = None

    def add(self, header: pb.WeightChunk, payload: Payload) -> None:
        if self.filled or payload.nbytes != self.nbytes:
            raise PushRejected(Reason.BAD_OFFSET, f"`{self.name}`: a tensor adopted in place is one message "
                                                  f"naming all its {self.nbytes} bytes")
        self.filled, self.checksum = len(self._data), header.checksum
        self._pending = self._worker.submit(self._hash)

    def _hash(self) -> None:
        self.lease.populate(self._start, len(self._data))
        self.digest.update(self._data)
        if self.lease.reused and self.digest.intdigest() != self.checksum:
            self._data = self.lease.refreshed(self._start, len(self._data))
            self.digest = xxhash.xxh3_64(self._data)

    def wait(self) -> None:
        if self._pending is not None:
            self._pending.result()

    def abort(self) -> None:
        """Nothing to stop: the hash reads bytes that are there."""

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


class Elsewhere:
    """One tensor whose bytes stay where its route put them, in a process that verifies them at the commit (an
    inference engine's worker: `engine_member.py`). The receiver checks its message as any other (name,
    shape, dtype, offset, one message for the whole tensor) and stages a placeholder, a meta tensor of the
    tensor's shape and dtype, which the target turns into the verified tensor or refuses. `Staging`'s
    interface, but for `wire`: there are no bytes here to forward."""

    def __init__(self, header: pb.WeightChunk, nbytes: int, holder: Holder):
        self.name, self.dtype, self.shape = header.name, FROM_WIRE[header.dtype], tuple(header.shape)
        self.nbytes, self.holder, self.added = nbytes, holder, False

    def add(self, header: pb.WeightChunk, payload: Payload) -> None:
        if self.added or payload.nbytes != self.nbytes or header.offset:
            raise PushRejected(Reason.BAD_OFFSET, f"`{self.name}`: a tensor held elsewhere is one message "
                                                  f"naming all its {self.nbytes} bytes")
        self.holder.describe(header)
        self.added = True

    def wait(self) -> None:
        """Nothing to wait for: no bytes are copied here."""

    def abort(self) -> None:
        """Nothing to stop."""

    def finish(self) -> torch.Tensor:
        if not self.added:
            raise PushRejected(Reason.TRUNCATED, f"`{self.name}`: got none of its {self.nbytes} bytes")
        return torch.empty(self.shape, dtype=self.dtype, device="meta")

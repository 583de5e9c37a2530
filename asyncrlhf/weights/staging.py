"""Staging one tensor of a push before its commit: the bytes the receiver copies (`Staging`, into the
`Buffers` kept between pushes, checksummed as they arrive on one worker thread), and the placeholder of a
tensor whose bytes another process holds and verifies at the commit (`Elsewhere`). Bytes adopted where they
lie are `leases.InPlace`; a delta's, `delta.DeltaStaging`. The receiver (`receiver.py`) picks one per tensor.
"""

from __future__ import annotations

from concurrent.futures import Future, ThreadPoolExecutor

import torch
import xxhash

from asyncrlhf._proto import weights_pb2 as pb
from asyncrlhf.weights.codec import FROM_WIRE, TO_WIRE, WireTensor, copy_hashed, verify
from asyncrlhf.weights.routes import HeldBytes, Holder, InPlaceBytes, Payload
from asyncrlhf.weights.vocabulary import PushRejected, Reason


class Staging:
    """One tensor being received: a byte buffer filled in order, with a running checksum. Offsets are
    checked at once; the copy and the checksum run on `worker` (one thread, so in order) while the gRPC
    thread waits for the next message. `wait` before reading the buffer or reusing it."""

    lease = None  # the bytes are the receiver's own

    def __init__(self, header: pb.WeightChunk, buffer: torch.Tensor, worker: ThreadPoolExecutor):
        self.name, self.dtype, self.shape = header.name, FROM_WIRE[header.dtype], tuple(header.shape)
        self.buffer, self._view, self._worker = buffer, buffer.numpy(), worker
        self.nbytes, self.filled, self.digest = buffer.numel(), 0, xxhash.xxh3_64()
        self.checksum: int | None = None
        self._pending: Future | None = None
        self._payload: Payload | None = None

    def add(self, header: pb.WeightChunk, payload: Payload) -> None:
        end = self.filled + payload.nbytes
        if header.offset != self.filled or end > self.nbytes or isinstance(payload, HeldBytes):
            where = (f"bytes at {header.offset} (+{payload.nbytes}) after {self.filled} of {self.nbytes} "
                     "bytes")
            raise PushRejected(Reason.BAD_OFFSET, f"`{self.name}`: {where}; send a tensor's bytes in order, "
                                                  "by one route")
        if end == self.nbytes:
            self.checksum = header.checksum  # unless the payload carries its own
        self._payload = payload
        self._pending = self._worker.submit(self._absorb, self.filled, end, payload)
        self.filled = end

    def _absorb(self, start: int, end: int, payload: Payload) -> None:
        if isinstance(payload, InPlaceBytes):  # a delta's bytes in a segment: copied, not adopted
            copy_hashed(self._view[start:end], payload.view, self.digest)
        elif not isinstance(payload, HeldBytes):  # (refused by `add`)
            carried = payload.copy_into(self._view[start:end], self.digest)
            if carried is not None:
                self.checksum = carried

    def wait(self) -> None:
        if self._pending is not None:
            self._pending.result()

    def abort(self) -> None:
        """The push is refused: stop a copy in progress (`wait` then returns soon)."""
        if self._payload is not None and not isinstance(self._payload, InPlaceBytes | HeldBytes):
            self._payload.abort()

    def staged(self) -> torch.Tensor:
        return self.buffer

    def wire(self) -> WireTensor:
        """The verified tensor as it came over the wire, with its checksum (after `finish`)."""
        data = memoryview(self._view)  # type: ignore[arg-type]  # numpy's stub: an ndarray is a buffer
        return WireTensor(self.name, TO_WIRE[self.dtype], self.shape, data, self.buffer, self.checksum)

    def finish(self) -> torch.Tensor:
        self.wait()
        verify(self.name, self.filled, self.nbytes, self.digest, self.checksum)
        return self.buffer.view(self.dtype).reshape(self.shape)


class Elsewhere:
    """One tensor whose bytes stay in a process that verifies them at the commit (an inference engine's
    worker: `sampling/hops/engine_member.py`). The receiver checks its message as any other (name, shape,
    dtype, offset, one message for the whole tensor) and stages a placeholder, a meta tensor of the tensor's
    shape and dtype, which the target turns into the verified tensor or refuses. No bytes here: neither a
    delta's base nor a relay's to forward."""

    lease = None

    def __init__(self, header: pb.WeightChunk, nbytes: int, holder: Holder):
        self.name, self.dtype, self.shape = header.name, FROM_WIRE[header.dtype], tuple(header.shape)
        self.nbytes, self.holder, self.added = nbytes, holder, False

    def add(self, header: pb.WeightChunk, payload: Payload) -> None:
        if self.added or not isinstance(payload, HeldBytes) or payload.nbytes != self.nbytes or header.offset:
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




class Buffers:
    """Staging buffers by tensor name, kept between pushes (a second copy of the pushed tensors in CPU
    memory), so a push does not pay for fresh allocations; `worker` copies and hashes, in order."""

    def __init__(self) -> None:
        self._buffers: dict[str, torch.Tensor] = {}
        self.worker = ThreadPoolExecutor(max_workers=1, thread_name_prefix="weight-stage")

    def get(self, name: str, nbytes: int) -> torch.Tensor:
        buffer = self._buffers.get(name)
        if buffer is None or buffer.numel() != nbytes:
            buffer = self._buffers[name] = torch.empty(nbytes, dtype=torch.uint8)
        return buffer

    def reuse(self, name: str, storage: torch.Tensor) -> None:
        """Stage the next push of `name` into `storage` (what the model let go of)."""
        self._buffers[name] = storage.detach().reshape(-1).view(torch.uint8)

    def drop(self, name: str) -> None:
        self._buffers.pop(name, None)

    def renew(self) -> None:
        """Stage the next pushes into new buffers (a relay still reads these)."""
        self._buffers = {}

    def storages(self) -> list[torch.Tensor]:
        return list(self._buffers.values())

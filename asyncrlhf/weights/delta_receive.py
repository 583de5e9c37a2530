"""Delta pushes, the generator's end: the base a delta applies onto (`Bases`) and a delta tensor staged,
applied and verified (`DeltaStaging`).

A push whose commit says `keep_base` leaves the receiver holding the tensors of the version it serves, as
pushed (wire dtype), until the next commit: a later push may then send a tensor as a delta onto that version
(`WeightChunk.delta`). What the receiver keeps costs no copy where it can help it:

- a staged tensor the target adopted as its live storage (`target.swap_in`) is the base as it is: nothing
  writes into live storage, and the next push stages into the storage it replaced;
- a staged tensor the target copied (another live dtype, an engine in other processes) is taken out of the
  staging buffers, which get the previous base's buffer instead: staging and base alternate;
- a tensor adopted in place from a shared-memory segment is the base while its lease holds; one the target
  copied is copied once more, into the previous base's buffer (the segment is the pusher's to rewrite).

A delta is staged like any tensor's bytes (any route), then `finish` writes the base and the delta's values
into a staging buffer (never the base: a refused push leaves base and served version as they were) and
checks the result's XXH3-64 against the message's checksum: a corrupted index or value, or a base that is not
the learner's, is `bad_checksum`.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Protocol

import torch
import xxhash

from asyncrlhf._proto import weights_pb2 as pb
from asyncrlhf.version import PolicyVersion
from asyncrlhf.weights.codec import DELTA_INDEX_BYTES, TO_WIRE, WireTensor, verify
from asyncrlhf.weights.routes import Lease, Payload
from asyncrlhf.weights.vocabulary import PushRejected, Reason


@dataclass(frozen=True)
class _Base:
    data: torch.Tensor  # the tensor's bytes (uint8, flat)
    dtype: torch.dtype
    owned: bool  # the receiver's alone (not live storage, not a segment's): reusable once superseded


class Copied(Protocol):
    """A delta's own bytes as staged (`receiver.Staging`)."""

    name: str
    dtype: torch.dtype
    shape: tuple[int, ...]
    buffer: torch.Tensor
    filled: int
    nbytes: int
    checksum: int | None

    def add(self, header: pb.WeightChunk, payload: Payload) -> None: ...

    def wait(self) -> None: ...

    def abort(self) -> None: ...


class DeltaStaging:
    """One delta tensor: its bytes staged by `delta` (a scratch buffer), then applied onto `base` into
    `result` (a staging buffer of the whole tensor's bytes) and the result verified."""

    lease = None  # the result is the receiver's own

    def __init__(self, header: pb.WeightChunk, delta: Copied, base: torch.Tensor, result: torch.Tensor):
        self.delta, self.base, self.result = delta, base, result
        self.name, self.dtype, self.shape = delta.name, delta.dtype, delta.shape
        self.elements = header.delta.elements

    def add(self, header: pb.WeightChunk, payload: Payload) -> None:
        self.delta.add(header, payload)

    def wait(self) -> None:
        self.delta.wait()

    def abort(self) -> None:
        self.delta.abort()

    def staged(self) -> torch.Tensor:
        return self.result

    def wire(self) -> WireTensor:
        """The resulting tensor (what a relay forwards: whole, with the checksum verified)."""
        data = memoryview(self.result.numpy())  # type: ignore[arg-type]  # numpy's stub: a buffer
        return WireTensor(self.name, TO_WIRE[self.dtype], self.shape, data, self.result, self.delta.checksum)

    def finish(self) -> torch.Tensor:
        d = self.delta
        d.wait()
        if d.filled != d.nbytes or d.checksum is None:
            raise PushRejected(Reason.TRUNCATED, f"`{self.name}`: got {d.filled} of {d.nbytes} bytes of its "
                                                 "delta")
        n = self.elements
        indices = d.buffer[:DELTA_INDEX_BYTES * n].view(torch.int32).long()
        values = d.buffer[DELTA_INDEX_BYTES * n:]
        if values.storage_offset() % self.dtype.itemsize:
            values = values.clone()
        out = self.result.view(self.dtype)
        if n and (int(indices.min()) < 0 or int(indices.max()) >= out.numel()):
            raise PushRejected(Reason.BAD_OFFSET, f"`{self.name}`: a delta index outside the tensor's "
                                                  f"{out.numel()} elements")
        self.result.copy_(self.base)
        out[indices] = values.view(self.dtype)
        digest = xxhash.xxh3_64(self.result.numpy())  # type: ignore[arg-type]  # a buffer
        nbytes = self.result.numel()
        verify(self.name, nbytes, nbytes, digest, d.checksum)
        return out.reshape(self.shape)


class Kept(Protocol):
    """A staged tensor of a committed push (`receiver.Staging`, `leases.InPlace`, `DeltaStaging`)."""

    @property
    def name(self) -> str: ...

    @property
    def dtype(self) -> torch.dtype: ...

    @property
    def lease(self) -> Lease | None:
        """Not None: a segment's bytes."""

    def staged(self) -> torch.Tensor:
        """Its bytes (uint8, flat)."""


class Pool(Protocol):
    """The receiver's staging buffers (`receiver.Buffers`)."""

    def reuse(self, name: str, storage: torch.Tensor) -> None: ...

    def drop(self, name: str) -> None: ...


class Bases:
    """The tensors of the version served, as pushed, kept when its push asked (`keep_base`): what deltas
    apply onto."""

    def __init__(self) -> None:
        self.version: PolicyVersion | None = None
        self._tensors: dict[str, _Base] = {}

    def base(self, header: pb.WeightChunk, dtype: torch.dtype, nbytes: int) -> torch.Tensor:
        """The bytes the delta of `header` applies onto (`nbytes` of the tensor in `dtype`), or `delta_base`
        when the receiver holds no such base."""
        d = header.delta
        if d.elements * dtype.itemsize > nbytes:
            raise PushRejected(Reason.BAD_OFFSET, f"`{header.name}`: a delta of {d.elements} elements, more "
                                                  "than the tensor has")
        wanted = PolicyVersion(d.base_lineage, d.base_version)
        if wanted != self.version:
            held = f"holds the base of {self.version}" if self.version is not None else "holds no base"
            raise PushRejected(Reason.DELTA_BASE, f"`{header.name}`: a delta onto {wanted}; this receiver "
                                                  f"{held}: push the tensor whole")
        kept = self._tensors.get(header.name)
        if kept is None or kept.dtype != dtype or kept.data.numel() != nbytes:
            raise PushRejected(Reason.DELTA_BASE, f"`{header.name}`: no base of that name, dtype and size "
                                                  f"in {wanted}: push the tensor whole")
        return kept.data

    def keep(self, version: PolicyVersion, keep: bool, done: Sequence[Kept],
             replaced: Mapping[str, torch.Tensor], buffers: Pool) -> None:
        """After the commit of `version` (`replaced`: what the target adopted, `target.swap_in`): keep its
        tensors as the base (`keep`), or none."""
        previous, self._tensors, self.version = self._tensors, {}, None
        if not keep:
            return
        for s in done:
            spare = previous.pop(s.name, None)
            reusable = spare.data if spare is not None and spare.owned else None
            data = s.staged()
            if s.name in replaced:  # live storage now: it stays as it is
                self._tensors[s.name] = _Base(data, s.dtype, owned=False)
            elif s.lease is not None:  # a segment's bytes, which the pusher may rewrite once released
                copy = reusable if reusable is not None and reusable.numel() == data.numel() else \
                    torch.empty_like(data)
                self._tensors[s.name] = _Base(copy.copy_(data), s.dtype, owned=True)
            else:  # the receiver's staging buffer: out of the staging pool while it is the base
                buffers.drop(s.name)
                if reusable is not None:
                    buffers.reuse(s.name, reusable)
                self._tensors[s.name] = _Base(data, s.dtype, owned=True)
        self._tensors.update(previous)  # a partial push: what it did not send is as it was
        self.version = version

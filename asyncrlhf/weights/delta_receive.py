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
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

import torch
import xxhash

from asyncrlhf._proto import weights_pb2 as pb
from asyncrlhf.version import PolicyVersion
from asyncrlhf.weights.codec import DELTA_INDEX_BYTES, TO_WIRE, WireTensor, nbytes_of
from asyncrlhf.weights.leases import Buffers
from asyncrlhf.weights.staging import InPlace, Staging, _verify
from asyncrlhf.weights.vocabulary import PushRejected, Reason


@dataclass(frozen=True)
class _Base:
    data: torch.Tensor  # the tensor's bytes (uint8, flat)
    dtype: torch.dtype
    owned: bool  # the receiver's alone (not live storage, not a segment's): reusable once superseded


class DeltaStaging(Staging):
    """One delta tensor: its bytes staged into a scratch buffer (`Staging`), then applied onto `base` into
    `result` (a staging buffer of the whole tensor's bytes) and the result verified."""

    def __init__(self, header: pb.WeightChunk, base: torch.Tensor, result: torch.Tensor,
                 worker: ThreadPoolExecutor):
        self.elements = header.delta.elements
        super().__init__(header, torch.empty(nbytes_of(header), dtype=torch.uint8), worker)
        self.base, self.result = base, result

    def wire(self) -> WireTensor:
        """The resulting tensor (what a relay forwards: whole, with the checksum verified)."""
        data = memoryview(self.result.numpy())  # type: ignore[arg-type]  # numpy's stub: a buffer
        return WireTensor(self.name, TO_WIRE[self.dtype], self.shape, data, self.result, self.checksum)

    def finish(self) -> torch.Tensor:
        self.wait()
        if self.filled != self.nbytes or self.checksum is None:
            raise PushRejected(Reason.TRUNCATED, f"`{self.name}`: got {self.filled} of {self.nbytes} bytes "
                                                 "of its delta")
        n = self.elements
        indices = self.buffer[:DELTA_INDEX_BYTES * n].view(torch.int32).long()
        values = self.buffer[DELTA_INDEX_BYTES * n:]
        if values.storage_offset() % self.dtype.itemsize:
            values = values.clone()
        out = self.result.view(self.dtype)
        if n and (int(indices.min()) < 0 or int(indices.max()) >= out.numel()):
            raise PushRejected(Reason.BAD_OFFSET, f"`{self.name}`: a delta index outside the tensor's "
                                                  f"{out.numel()} elements")
        self.result.copy_(self.base)
        out[indices] = values.view(self.dtype)
        digest = xxhash.xxh3_64(self.result.numpy())  # type: ignore[arg-type]  # a buffer
        _verify(self.name, self.nbytes, self.nbytes, digest, self.checksum)
        return out.reshape(self.shape)


def _staged_bytes(s: Staging | InPlace) -> torch.Tensor:
    if isinstance(s, DeltaStaging):
        return s.result
    if isinstance(s, Staging):
        return s.buffer
    return s.tensor().reshape(-1).view(torch.uint8)


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

    def keep(self, version: PolicyVersion, keep: bool, done: Sequence[Staging | InPlace],
             replaced: Mapping[str, torch.Tensor], buffers: Buffers) -> None:
        """After the commit of `version` (`replaced`: what the target adopted, `target.swap_in`): keep its
        tensors as the base (`keep`), or none."""
        previous, self._tensors, self.version = self._tensors, {}, None
        if not keep:
            return
        for s in done:
            spare = previous.pop(s.name, None)
            reusable = spare.data if spare is not None and spare.owned else None
            data = _staged_bytes(s)
            if s.name in replaced:  # live storage now: it stays as it is
                self._tensors[s.name] = _Base(data, s.dtype, owned=False)
            elif isinstance(s, InPlace):  # a segment's bytes, which the pusher may rewrite once released
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

"""Delta encoding of a version against the one before it: per tensor, the flat indices of the elements whose
bits changed and their new values. With full fine-tuning only a few percent of bf16 weights change in a step
(an Adam update of about `lr` moves a weight across a bf16 rounding step only when `lr` is a sizeable share
of that step), so the indices and values of a version are a fraction of its bytes.

Bits, not values, decide what changed (so -0.0 against 0.0 and NaN payloads are never lost), and a delta
applied to the base it was made against gives the new tensor bit for bit: its checksum is the new tensor's.
A delta is worth sending only below `full_bytes`: an element costs 4 bytes of index and its own bytes of
value, so a bf16 tensor gains once fewer than 1 element in 3 changed.

`DeltaPushes` is the learner's end of delta pushes on the wire (`learner.push_delta`). The generator's end:
the base a delta applies onto (`Bases`) and a delta tensor staged, applied and verified (`DeltaStaging`).
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
docs/weights.md, "Delta pushes".
"""

from __future__ import annotations

import threading
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, replace
from typing import Protocol

import numpy as np
import torch
import xxhash

from asyncrlhf._proto import weights_pb2 as pb
from asyncrlhf.version import PolicyVersion
from asyncrlhf.weights.codec import DELTA_INDEX_BYTES, TO_WIRE, Snapshot, WireTensor, verify
from asyncrlhf.weights.leases import Staged
from asyncrlhf.weights.routes import Payload
from asyncrlhf.weights.vocabulary import PushRejected, Reason

INDEX_DTYPE = torch.int32  # flat indices; tensors of 2**31 elements or more are sent whole
_BITS = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}


@dataclass(frozen=True)
class Delta:
    """The elements of one tensor that changed: `indices` (int32, flat, ascending) and `values` (the new
    tensor's dtype)."""

    indices: torch.Tensor  # (n,)
    values: torch.Tensor  # (n,)

    @property
    def nbytes(self) -> int:
        return full_bytes(self.indices) + full_bytes(self.values)


def _bits(t: torch.Tensor) -> torch.Tensor:
    return t.detach().reshape(-1).view(_BITS[t.element_size()])


def encode(base: torch.Tensor, new: torch.Tensor, scratch: np.ndarray | None = None) -> Delta | None:
    """The delta that turns `base` into `new` (same shape and dtype, contiguous, CPU), or None where a delta
    cannot describe it (shape or dtype differ, too many elements to index). `scratch`: a bool array of at
    least `new.numel()` elements to compare into (kept across versions: no fresh pages to fault in; with it
    and numpy's flatnonzero, 5x the speed of torch's nonzero measured on the development machine)."""
    if base.shape != new.shape or base.dtype != new.dtype or new.numel() >= 2 ** 31:
        return None
    n = new.numel()
    mask = scratch[:n] if scratch is not None and scratch.size >= n else np.empty(n, dtype=np.bool_)
    bits = _bits(new).numpy()
    np.not_equal(_bits(base).numpy(), bits, out=mask)
    changed = np.flatnonzero(mask)
    values = torch.from_numpy(bits[changed]).view(new.dtype)  # gathered as bits, by numpy: no bf16 there
    return Delta(torch.from_numpy(changed.astype(np.int32)), values)


def apply(base: torch.Tensor, delta: Delta) -> torch.Tensor:
    """A new tensor: `base` with the delta's values written at its indices (base untouched)."""
    out = base.detach().clone().reshape(-1)
    out[delta.indices.long()] = delta.values
    return out.reshape(base.shape)


def full_bytes(t: torch.Tensor) -> int:
    return t.numel() * t.element_size()


def worth_sending(delta: Delta | None, t: torch.Tensor) -> bool:
    """Whether the delta is smaller than the tensor itself."""
    return delta is not None and delta.nbytes < full_bytes(t)


def as_wire(t: WireTensor, d: Delta, base: PolicyVersion) -> WireTensor:
    """Tensor `t` sent as delta `d` onto `base`: its bytes the indices then the values, its checksum the
    resulting tensor's (`t`'s own)."""
    payload = torch.from_numpy(np.concatenate([d.indices.numpy().view(np.uint8),
                                               _bits(d.values).numpy().view(np.uint8)]))
    data = memoryview(payload.numpy())  # type: ignore[arg-type]  # numpy's stub: an ndarray is a buffer
    checksum = t.checksum if t.checksum is not None else xxhash.xxh3_64_intdigest(t.data)
    return WireTensor(t.name, t.dtype, t.shape, data, payload, checksum,
                      pb.TensorDelta(elements=d.indices.numel(), base_lineage=base.lineage,
                                     base_version=base.step))


@dataclass(frozen=True)
class Version:
    """One version as the pusher sends it: `full` (every tensor whole, the receivers asked to keep it as a
    base) and, where the version before it was kept, `delta` (each tensor whose delta is smaller sent as one
    onto `base`, the others whole)."""

    full: Snapshot
    delta: Snapshot | None = None
    base: PolicyVersion | None = None


class DeltaPushes:
    """The learner's end of delta pushes (`learner.push_delta`): the last version pushed, as pushed (CPU, the
    push dtype; updated in place, version after version), which deltas are made against, and the version
    each generator acknowledged keeping (`acknowledged`; forgotten at a failure). A generator gets a
    version's delta only if it acknowledged the delta's base; any other gets the version whole."""

    def __init__(self) -> None:
        self._base: dict[str, torch.Tensor] = {}
        self._base_version: PolicyVersion | None = None
        self._acked: dict[str, PolicyVersion] = {}  # address -> the version it kept
        self._last: Version | None = None
        self._mask = np.empty(0, dtype=np.bool_)  # `encode`'s scratch, as large as the largest tensor
        self._lock = threading.Lock()

    def version(self, push: Snapshot, addresses: Sequence[str]) -> Version:
        """`push` as sent to `addresses`: encoded once per version (later rounds of the same version, late
        generators, reuse it), as a delta only if one of them holds the base."""
        with self._lock:
            if self._last is not None and self._last.full.version == push.version:
                return self._last
            base = self._base_version
            wanted = base is not None and any(self._acked.get(a) == base for a in addresses)
            tensors = self._advance(push, base if wanted else None)
            full = replace(push, keep_base=True)
            self._last = Version(full, replace(full, tensors=tensors), base) if wanted else Version(full)
            self._base_version = push.version
            return self._last

    def _advance(self, push: Snapshot, base: PolicyVersion | None) -> list[WireTensor]:
        """Make `push` the base, in place; with a `base` version, return each tensor as sent against it."""
        sent = []
        largest = max((t.tensor.numel() for t in push.tensors), default=0)
        if self._mask.size < largest:
            self._mask = np.empty(largest, dtype=np.bool_)
        for t in push.tensors:
            new, old = t.tensor, self._base.get(t.name)
            d = encode(old, new, self._mask) if base is not None and old is not None else None
            if d is not None and base is not None and worth_sending(d, new):
                sent.append(as_wire(t, d, base))
                _bits(old).numpy()[d.indices.numpy()] = _bits(d.values).numpy()  # type: ignore[arg-type]
                continue
            sent.append(t)
            if old is not None and old.shape == new.shape and old.dtype == new.dtype:
                old.copy_(new)
            else:
                self._base[t.name] = new.detach().clone().contiguous()
        return sent

    def snapshot(self, version: Version, address: str) -> Snapshot:
        """What `address` is sent of `version`: its delta if it acknowledged the delta's base."""
        if version.delta is not None and self._acked.get(address) == version.base:
            return version.delta
        return version.full

    def acknowledged(self, address: str, version: PolicyVersion) -> None:
        """`address` committed `version`, kept as its base."""
        self._acked[address] = version

    def forget(self, address: str) -> None:
        """`address`'s base is unknown (a failed push: it may have restarted, or lost its base)."""
        self._acked.pop(address, None)


@dataclass(frozen=True)
class _Base:
    data: torch.Tensor  # the tensor's bytes (uint8, flat)
    dtype: torch.dtype
    owned: bool  # the receiver's alone (not live storage, not a segment's): reusable once superseded


class Copied(Protocol):
    """A delta's own bytes as staged (`staging.Staging`)."""

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


class Pool(Protocol):
    """The receiver's staging buffers (`staging.Buffers`)."""

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

    def keep(self, version: PolicyVersion, keep: bool, done: Sequence[Staged],
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

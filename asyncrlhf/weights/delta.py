"""Delta encoding of a version against the one before it: per tensor, the flat indices of the elements whose
bits changed and their new values. With full fine-tuning only a few percent of bf16 weights change in a step
(an Adam update of about `lr` moves a weight across a bf16 rounding step only when `lr` is a sizeable share
of that step), so the indices and values of a version are a fraction of its bytes.

Bits, not values, decide what changed (so -0.0 against 0.0 and NaN payloads are never lost), and a delta
applied to the base it was made against gives the new tensor bit for bit: its checksum is the new tensor's.
A delta is worth sending only below `full_bytes`: an element costs 4 bytes of index and its own bytes of
value, so a bf16 tensor gains once fewer than 1 element in 3 changed.

`DeltaPushes` is the learner's end of delta pushes on the wire (`learner.push_delta`); the receiver's is
`delta_receive.py`. docs/weights.md, "Delta pushes".
"""

from __future__ import annotations

import threading
from collections.abc import Sequence
from dataclasses import dataclass, replace

import numpy as np
import torch
import xxhash

from asyncrlhf._proto import weights_pb2 as pb
from asyncrlhf.version import PolicyVersion
from asyncrlhf.weights.codec import Snapshot, WireTensor

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

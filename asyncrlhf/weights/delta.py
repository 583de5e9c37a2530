"""Delta encoding of a version against the one before it: per tensor, the flat indices of the elements whose
bits changed and their new values. With full fine-tuning only a few percent of bf16 weights change in a step
(an Adam update of about `lr` moves a weight across a bf16 rounding step only when `lr` is a sizeable share
of that step), so the indices and values of a version are a fraction of its bytes.

Bits, not values, decide what changed (so -0.0 against 0.0 and NaN payloads are never lost), and a delta
applied to the base it was made against gives the new tensor bit for bit: its checksum is the new tensor's.
A delta is worth sending only below `full_bytes`: an element costs 4 bytes of index and its own bytes of
value, so a bf16 tensor gains once fewer than 1 element in 3 changed.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

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


def encode(base: torch.Tensor, new: torch.Tensor) -> Delta | None:
    """The delta that turns `base` into `new` (same shape and dtype, contiguous, CPU), or None where a delta
    cannot describe it (shape or dtype differ, too many elements to index)."""
    if base.shape != new.shape or base.dtype != new.dtype or new.numel() >= 2 ** 31:
        return None
    changed = torch.nonzero(_bits(base) != _bits(new)).reshape(-1)
    return Delta(changed.to(INDEX_DTYPE), new.reshape(-1)[changed])


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

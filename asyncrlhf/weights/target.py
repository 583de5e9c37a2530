"""`WeightTarget`: the one interface that applies weights, and `ModuleTarget`, the one over a torch module.

The sampling backends, `ModuleTarget` and the generator service's `WeightSwap` implement it; the receiver,
the offline stages and the tests call it. A target is handed a verified set of tensors and the
`PolicyVersion` they are, all at once: the atomic swap.
"""

from __future__ import annotations

import threading
from collections.abc import Iterable, Mapping
from typing import Protocol

import torch

from asyncrlhf.version import PolicyVersion


class WeightTarget(Protocol):
    """What weights are applied to: the live named tensors a push is verified against, and the atomic swap."""

    def named_tensors(self) -> Mapping[str, torch.Tensor]:
        """Name -> live tensor (only shape and dtype are read); a push may update exactly these names."""

    def apply_weights(
        self, tensors: Mapping[str, torch.Tensor], version: PolicyVersion, *, adopt: bool = False
    ) -> Mapping[str, torch.Tensor] | None:
        """Swap in verified tensors all at once and serve them as `version`. They are CPU tensors with the
        live shapes, in the pushed dtype (a floating push dtype may differ from the live one: copy with a
        cast). Without `adopt` the caller keeps them: copy them and keep no reference. With `adopt` (the
        caller hands them over, as a `WeightReceiver` does with its staging buffers) a target may make some
        its live storage with no copy (`swap_in`) and return the tensors they replaced, which the model no
        longer uses and the caller reuses; tensors it copies stay the caller's (the receiver stages the next
        push into them), so it keeps no reference to those either. Adopting nothing, it returns {} or None."""


def swap_in(
    live: Mapping[str, torch.Tensor], tensors: Mapping[str, torch.Tensor], *, adopt: bool
) -> dict[str, torch.Tensor]:
    """Make each of `tensors` the storage of the live tensor of the same name (`live[name].data = new`, no
    copy) where that is safe: same dtype and device, contiguous, storage not shared with another live name
    (tied weights); copy the rest (all of them when not `adopt`). Returns the replaced storages, by name, for
    the caller to reuse."""
    owners: dict[int, int] = {}
    for t in live.values():
        owners[t.data_ptr()] = owners.get(t.data_ptr(), 0) + 1
    replaced: dict[str, torch.Tensor] = {}
    with torch.no_grad():
        for name, new in tensors.items():
            old = live[name]
            if (adopt and old.dtype == new.dtype and old.device == new.device and old.is_contiguous()
                    and new.is_contiguous() and owners[old.data_ptr()] == 1):
                replaced[name] = old.data
                old.data = new
            else:
                old.copy_(new)
    return replaced


class ModuleTarget:
    """A `WeightTarget` over a torch module's state dict (optionally only the names in `names`, e.g. LoRA
    adapters). `lock` is held while applying: a generator holds it around each generation batch, so a
    push lands between batches and never mid-group. A module has no version of its own: the receiver's
    `version` is the one it serves."""

    def __init__(self, module: torch.nn.Module, names: Iterable[str] | None = None):
        self.module = module
        self.lock = threading.Lock()
        state = module.state_dict(keep_vars=True)
        wanted = set(state) if names is None else set(names)
        missing = wanted - set(state)
        if missing:
            raise KeyError(f"ModuleTarget: the module has no tensors named {sorted(missing)[:5]}")
        self._live = {name: state[name] for name in state if name in wanted}

    def named_tensors(self) -> Mapping[str, torch.Tensor]:
        return self._live

    def apply_weights(
        self, tensors: Mapping[str, torch.Tensor], version: PolicyVersion, *, adopt: bool = False
    ) -> dict[str, torch.Tensor]:
        with self.lock:
            return swap_in(self._live, tensors, adopt=adopt)

"""Bytes a receiver adopts where they lie (a same-host segment's): each tensor verified in place (`InPlace`),
and the leases on those bytes kept past a push (`Holds`): while live tensors view them, and while a relay
forwards the committed version (the receiver is held: `hold`), whose bytes must stay as committed.
"""

from __future__ import annotations

import threading
from collections.abc import Iterable, Mapping, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Protocol

import torch
import xxhash

from asyncrlhf._proto import weights_pb2 as pb
from asyncrlhf.weights.codec import FROM_WIRE, TO_WIRE, WireTensor, verify
from asyncrlhf.weights.routes import InPlaceBytes, Lease, Payload
from asyncrlhf.weights.vocabulary import PushRejected, Reason


class InPlace:
    """One tensor verified where it lies: a view of its bytes (in a same-host segment, read-locked by its
    `Lease`: the pusher cannot rewrite them while this receiver holds it), its pages mapped in and hashed on
    `worker`. The staged tensor is that view: no copy. `staging.Staging`'s interface. Read through a mapping
    kept from an earlier version, bytes that fail the checksum are read once more through a fresh mapping (a
    page of the kept one may hold this process's own write)."""

    def __init__(self, header: pb.WeightChunk, nbytes: int, lent: InPlaceBytes, worker: ThreadPoolExecutor):
        self.name, self.dtype, self.shape = header.name, FROM_WIRE[header.dtype], tuple(header.shape)
        self.nbytes, self._worker = nbytes, worker
        self.lease: Lease = lent.lease  # held while live tensors view the bytes
        self.filled, self.digest = 0, xxhash.xxh3_64()
        self.checksum: int | None = None
        self._data, self._start = lent.view, lent.start
        self._pending: Future | None = None

    def add(self, header: pb.WeightChunk, payload: Payload) -> None:
        if self.filled or not isinstance(payload, InPlaceBytes) or payload.nbytes != self.nbytes:
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

    def staged(self) -> torch.Tensor:
        return self.tensor().reshape(-1).view(torch.uint8)

    def wire(self) -> WireTensor:
        tensor = self.tensor()
        return WireTensor(self.name, TO_WIRE[self.dtype], self.shape, self._data, tensor, self.checksum)

    def finish(self) -> torch.Tensor:
        self.wait()
        verify(self.name, self.filled, self.nbytes, self.digest, self.checksum)
        return self.tensor()


class Staged(Protocol):
    """A staged tensor of a committed push (`staging.Staging`, `InPlace`, `delta.DeltaStaging`)."""

    @property
    def name(self) -> str: ...

    @property
    def dtype(self) -> torch.dtype: ...

    @property
    def lease(self) -> Lease | None:
        """None: the bytes are the receiver's own; else a segment's."""

    def staged(self) -> torch.Tensor:
        """Its bytes (uint8, flat)."""


class Holds:
    """The leases live tensors view (by tensor name) and the relays reading the committed version
    (`hold`/`release`): a lease no live tensor needs goes back once no relay holds the receiver."""

    def __init__(self) -> None:
        self._backing: dict[str, Lease] = {}  # live tensor name -> the lease its storage views
        self._unheld: list[Lease] = []  # leases no live tensor needs, released once no relay holds them
        self._holds = 0
        self._lock = threading.Lock()

    @property
    def held(self) -> bool:
        with self._lock:
            return self._holds > 0

    @property
    def leasing(self) -> bool:
        """Whether a live tensor views leased bytes."""
        return bool(self._backing)

    def hold(self) -> None:
        with self._lock:
            self._holds += 1

    def release(self) -> None:
        with self._lock:
            self._holds -= 1
            unheld, self._unheld = (self._unheld, []) if not self._holds else ([], self._unheld)
        for lease in unheld:
            lease.release()

    def rebind(self, replaced: Mapping[str, torch.Tensor], done: Sequence[Staged]) -> set[str]:
        """After a swap: keep exactly the leases whose bytes live tensors now view (`replaced`: the tensors
        the target adopted); the names whose replaced storage viewed leased bytes (not the receiver's own to
        stage into)."""
        before = {id(lease): lease for lease in self._backing.values()}
        viewed = set()
        for s in done:
            if s.name not in replaced:
                continue  # copied into the live storage, which keeps whatever backs it
            previous = self._backing.pop(s.name, None)
            if previous is not None:
                viewed.add(s.name)
            if s.lease is not None:
                self._backing[s.name] = s.lease
                s.lease.keep()
        kept = {id(lease) for lease in self._backing.values()}
        self._release_when_unheld([lease for key, lease in before.items() if key not in kept])
        with self._lock:
            if self._holds:  # a relay reads this version's bytes: the push's other leases stay until it ends
                pushed = {id(s.lease): s.lease for s in done if s.lease is not None}
                for lease in [lease for key, lease in pushed.items() if key not in kept]:
                    lease.keep()
                    self._unheld.append(lease)
        return viewed

    def _release_when_unheld(self, leases: Iterable[Lease]) -> None:
        with self._lock:
            if self._holds:
                self._unheld.extend(leases)
                return
        for lease in leases:
            lease.release()

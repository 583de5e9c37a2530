"""What a receiver keeps past a push: the staging buffers the next byte push is copied into, the leases on
segment bytes its live tensors view, and the bytes a relay still reads (`hold`).

While a relay forwards the committed version (the receiver is held), its bytes must stay as committed: a
next push stages into fresh buffers, and the leases of the version go back only once the relay is done.
"""

from __future__ import annotations

import threading
from collections.abc import Iterable, Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor

import torch

from asyncrlhf.weights.routes import Lease
from asyncrlhf.weights.shm_read import SegmentMaps, ShmSource
from asyncrlhf.weights.staging import InPlace, Staging


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


class Holds:
    """The segment leases live tensors view (`backing`, by tensor name), the mappings of the segments
    (`maps`, kept across pushes), and the relays reading the committed version (`hold`/`release`): a lease
    no live tensor needs goes back once no relay holds the receiver."""

    def __init__(self) -> None:
        self.maps = SegmentMaps()
        self._backing: dict[str, Lease] = {}  # live tensor name -> the lease its storage views
        self._unheld: list[Lease] = []  # leases no live tensor needs, released once no relay holds them
        self._holds = 0
        self._lock = threading.Lock()

    @property
    def held(self) -> bool:
        with self._lock:
            return self._holds > 0

    def hold(self) -> None:
        with self._lock:
            self._holds += 1

    def release(self) -> None:
        with self._lock:
            self._holds -= 1
            unheld, self._unheld = (self._unheld, []) if not self._holds else ([], self._unheld)
        for lease in unheld:
            lease.release()

    def prune(self) -> None:
        """Drop the mappings of segments that nothing keeps and whose pusher removed them."""
        self.maps.prune(lease.name for lease in (*self._backing.values(), *self._unheld))

    def rebind(self, replaced: Mapping[str, torch.Tensor], done: Sequence[Staging | InPlace],
               segments: ShmSource, buffers: Buffers) -> None:
        """After a swap: stage the next byte push into the storage the model let go of (never into a view of
        a segment), and keep exactly the segment leases whose bytes live tensors still view."""
        before = {id(lease): lease for lease in self._backing.values()}
        for s in done:
            if s.name not in replaced:
                continue  # copied into the live storage, which keeps whatever backs it
            previous = self._backing.pop(s.name, None)
            if s.lease is not None:
                self._backing[s.name] = s.lease
                segments.keep(s.lease)
            if previous is None:  # the replaced storage is the receiver's own: reuse it
                buffers.reuse(s.name, replaced[s.name])
            elif s.lease is None:  # its buffer is live now, and the replaced one viewed a segment
                buffers.drop(s.name)
        kept = {id(lease) for lease in self._backing.values()}
        self._release_when_unheld([lease for key, lease in before.items() if key not in kept])
        with self._lock:
            if self._holds:  # a relay reads this version's bytes: the push's other leases stay until it ends
                for lease in segments.leases.values():
                    if id(lease) not in kept:
                        segments.keep(lease)
                        self._unheld.append(lease)

    def _release_when_unheld(self, leases: Iterable[Lease]) -> None:
        with self._lock:
            if self._holds:
                self._unheld.extend(leases)
                return
        for lease in leases:
            lease.release()

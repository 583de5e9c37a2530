"""The receiving side of a push: stage, verify, atomic swap, and the one interface that applies weights.

A `WeightReceiver` stages a push chunk by chunk, verifying every tensor against the live model
(`WeightTarget.named_tensors`: name, shape, dtype) and its checksum, and only on the commit message hands
the complete set to `WeightTarget.apply_weights` with the version it verified: the atomic swap. Any problem
raises `PushRejected` before anything live is touched, so the target keeps serving its previous version
bit for bit. Nothing read from the wire is unpickled: tensors are raw bytes viewed with a known dtype.

`WeightTarget` is the one way weights are applied: the sampling backends, `ModuleTarget` (a torch module)
and the generator service's `WeightSwap` implement it; the receiver, the offline stages and the tests call it.
"""

from __future__ import annotations

import contextlib
import threading
import time
from collections.abc import Callable, Iterable, Iterator, Mapping
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Protocol

import torch

from asyncrlhf._proto import weights_pb2 as pb
from asyncrlhf.weights.codec import FROM_WIRE, WireTensor
from asyncrlhf.weights.shm_read import Lease, SegmentMaps, SegmentReader
from asyncrlhf.weights.staging import ChunkData, InPlace, PushRejected, Reason, Staging

__all__ = ["PushRejected", "Reason", "WeightTarget", "ModuleTarget", "PushResult", "ReceiverStatus",
           "WeightReceiver", "swap_in"]

class WeightTarget(Protocol):
    """What weights are applied to: the live named tensors a push is verified against, and the atomic swap."""

    def named_tensors(self) -> Mapping[str, torch.Tensor]:
        """Name -> live tensor (only shape and dtype are read); a push may update exactly these names."""

    def apply_weights(
        self, tensors: Mapping[str, torch.Tensor], version: int, *, adopt: bool = False
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
        self, tensors: Mapping[str, torch.Tensor], version: int, *, adopt: bool = False
    ) -> dict[str, torch.Tensor]:
        with self.lock:
            return swap_in(self._live, tensors, adopt=adopt)


@dataclass(frozen=True)
class PushResult:
    version: int
    tensor_count: int
    bytes: int
    apply_seconds: float
    lineage: int = 0
    partial: bool = False
    # The committed tensors as received (wire dtype, the checksums verified), in the order sent: what a relay
    # forwards. Their bytes stay as committed only while the receiver is held (`WeightReceiver.hold`).
    tensors: tuple[WireTensor, ...] = ()


@dataclass(frozen=True)
class ReceiverStatus:
    version: int
    updated_at: float
    tensor_count: int
    lineage: int = 0


def _as_pairs(messages: Iterable) -> Iterator[tuple[pb.WeightChunk, ChunkData]]:
    for message in messages:
        yield message if isinstance(message, tuple) else (message, memoryview(message.data))


class WeightReceiver:
    """Stages pushes and applies each atomically on commit; pushes are handled one at a time. Staging
    buffers of byte-stream pushes are kept between pushes (a second copy of the pushed tensors in CPU
    memory), so a push does not pay for fresh allocations — except while the receiver is held (`hold`): a
    relay is reading the committed version's bytes, so pushes stage into fresh buffers until it is done.
    A same-host push is verified in the pusher's segment and adopted from there (`InPlace`): the live
    tensors the target adopts are views of the segment, and the receiver keeps the segment's lease for as
    long as any live tensor views it (`_backing`) or a relay reads it (`hold`), then releases it so the
    pusher may rewrite it. Its mappings of the segments are kept across pushes (`SegmentMaps`)."""

    def __init__(self, target: WeightTarget, version: int = 0, lineage: int = 0,
                 on_lineage: Callable[[int], None] | None = None):
        """`on_lineage(lineage)` is called just before a push's `apply_weights`, with the lineage of the
        version being applied (the generator records it with the version, under its generation gate)."""
        self.target = target
        self.version, self.lineage, self.on_lineage = version, lineage, on_lineage
        self._lineage = lineage  # the lineage of the push being received
        self.updated_at = 0.0
        self._lock = threading.Lock()
        self._buffers: dict[str, torch.Tensor] = {}
        self._backing: dict[str, Lease] = {}  # live tensor name -> the segment lease its storage views
        self._maps = SegmentMaps()
        self._unheld: list[Lease] = []  # leases no live tensor needs, released once no relay holds them
        self._holds = 0
        self._holds_lock = threading.Lock()
        self._worker = ThreadPoolExecutor(max_workers=1, thread_name_prefix="weight-stage")

    def status(self) -> ReceiverStatus:
        return ReceiverStatus(self.version, self.updated_at, len(self.target.named_tensors()), self.lineage)

    def hold(self) -> None:
        """Keep the bytes of the version being received (or last committed) as they are until `release`: the
        `tensors` of its `PushResult` stay valid. May be called from inside `receive` (while consuming the
        messages)."""
        with self._holds_lock:
            self._holds += 1

    def release(self) -> None:
        with self._holds_lock:
            self._holds -= 1
            unheld, self._unheld = (self._unheld, []) if not self._holds else ([], self._unheld)
        for lease in unheld:
            lease.release()

    def _release_when_unheld(self, leases: Iterable[Lease]) -> None:
        with self._holds_lock:
            if self._holds:
                self._unheld.extend(leases)
                return
        for lease in leases:
            lease.release()

    def receive(self, messages: Iterable[tuple[pb.WeightChunk, ChunkData] | pb.WeightChunk]) -> PushResult:
        """Consume one push of (header, data) pairs (see `decode_chunk`; data: the bytes, or the push's data
        connection, `channel.Session`) or plain WeightChunks; raise
        `PushRejected` (old weights intact) or return once the new version is live."""
        with self._lock:
            try:
                with SegmentReader(self._maps) as segments:  # same-host pushes: bytes from shared memory
                    return self._receive(segments.resolve(_as_pairs(messages)), segments)
            finally:
                self._maps.prune(lease.name for lease in (*self._backing.values(), *self._unheld))

    def _receive(self, messages: Iterable[tuple[pb.WeightChunk, ChunkData]], segments: SegmentReader,
                 ) -> PushResult:
        with self._holds_lock:
            if self._holds:  # a relay still reads the buffers of a version: stage into new ones
                self._buffers = {}
        live = self.target.named_tensors()
        staged: dict[str, torch.Tensor] = {}
        done: list[Staging | InPlace] = []
        current: Staging | InPlace | None = None
        version: int | None = None
        received = 0
        try:
            for header, data in messages:
                version = self._check_version(header, version)
                if header.commit:
                    if current is not None:
                        staged[current.name] = current.finish()
                        done.append(current)
                    return self._commit(header, live, staged, received, done, segments)
                if current is None or header.name != current.name:
                    if current is not None:
                        staged[current.name] = current.finish()
                        done.append(current)
                    current = self._start(header, live, staged, segments)
                current.add(header, data)
                received += len(data) if isinstance(data, memoryview) else current.nbytes
        except BaseException:
            if current is not None:  # no copy may still write into a buffer the next push reuses:
                current.abort()  # a read from the data channel stops at once (its error is this one's)
                with contextlib.suppress(Exception):
                    current.wait()
            raise
        if current is not None:
            current.wait()
        where = f" in `{current.name}`" if current is not None else ""
        raise PushRejected("truncated", f"the stream ended before the commit message{where}")

    def _check_version(self, header: pb.WeightChunk, version: int | None) -> int:
        """A push is newer when its lineage is (any version: a restarted learner resumes from a checkpoint,
        at a lower version than it had reached), or, in the same lineage, its version is."""
        if version is None:
            if header.lineage < self.lineage:
                raise PushRejected("stale_lineage", f"lineage {header.lineage} is older than the lineage "
                                                    f"{self.lineage} served (a learner that was replaced?)")
            if header.lineage == self.lineage and header.version <= self.version:
                raise PushRejected("stale_version", f"version {header.version} is not newer than "
                                                    f"{self.version} (lineage {self.lineage})")
            self._lineage = header.lineage
            return header.version
        if header.version != version or header.lineage != self._lineage:
            was, now = (self._lineage, version), (header.lineage, header.version)
            raise PushRejected("stale_version", f"(lineage, version) changed mid-push from {was} to {now}")
        return version

    def _start(self, header: pb.WeightChunk, live: Mapping[str, torch.Tensor], staged: Mapping,
               segments: SegmentReader) -> Staging | InPlace:
        name = header.name
        if name not in live:
            raise PushRejected("unknown_tensor", f"`{name}` is not a tensor of this model")
        if name in staged:
            raise PushRejected("duplicate_tensor", f"`{name}` was sent twice in one push")
        target = live[name]
        if tuple(header.shape) != tuple(target.shape):
            raise PushRejected("shape_mismatch",
                               f"`{name}`: pushed {list(header.shape)}, live {list(target.shape)}")
        wire = FROM_WIRE.get(header.dtype)
        castable = wire is not None and wire.is_floating_point and target.dtype.is_floating_point
        if wire is None or (wire != target.dtype and not castable):
            raise PushRejected("dtype_mismatch",
                               f"`{name}`: pushed {pb.DType.Name(header.dtype)}, live {target.dtype}")
        nbytes = target.numel() * wire.itemsize
        if header.shm_segment:
            return InPlace(header, nbytes, segments.leases[header.shm_segment], self._worker)
        buffer = self._buffers.get(name)
        if buffer is None or buffer.numel() != nbytes:
            buffer = self._buffers[name] = torch.empty(nbytes, dtype=torch.uint8)
        return Staging(header, buffer, self._worker)

    def _commit(
        self, header: pb.WeightChunk, live: Mapping, staged: dict[str, torch.Tensor], received: int,
        done: list[Staging | InPlace], segments: SegmentReader,
    ) -> PushResult:
        if header.tensor_count != len(staged):
            raise PushRejected("tensor_count",
                               f"commit says {header.tensor_count} tensors, received {len(staged)}")
        missing = set(live) - set(staged)
        if missing and not header.partial:
            example = min(missing)
            raise PushRejected("missing_tensors", f"{len(missing)} live tensors not sent (e.g. `{example}`); "
                                                  "mark the commit partial to update only some")
        start = time.perf_counter()
        if self.on_lineage is not None:
            self.on_lineage(self._lineage)
        replaced = self.target.apply_weights(staged, header.version, adopt=True) or {}
        self._rebind(replaced, done, segments)
        self.version, self.lineage, self.updated_at = header.version, self._lineage, time.time()
        return PushResult(header.version, len(staged), received, time.perf_counter() - start, self.lineage,
                          header.partial, tuple(s.wire() for s in done))

    def _rebind(self, replaced: Mapping[str, torch.Tensor], done: list[Staging | InPlace],
                segments: SegmentReader) -> None:
        """After a swap: stage the next byte-stream push into the storage the model let go of (never into a
        view of a segment), and hold exactly the segment leases whose bytes live tensors still view."""
        before = {id(lease): lease for lease in self._backing.values()}
        for s in done:
            if s.name not in replaced:
                continue  # copied into the live storage, which keeps whatever backs it
            previous = self._backing.pop(s.name, None)
            if isinstance(s, InPlace):
                self._backing[s.name] = s.lease
                segments.keep(s.lease)
            if previous is None:  # the replaced storage is the receiver's own: reuse it
                self._buffers[s.name] = replaced[s.name].detach().reshape(-1).view(torch.uint8)
            elif isinstance(s, Staging):  # its buffer is live now, and the replaced one viewed a segment
                self._buffers.pop(s.name, None)
        held = {id(lease) for lease in self._backing.values()}
        self._release_when_unheld([lease for key, lease in before.items() if key not in held])
        with self._holds_lock:
            if self._holds:  # a relay reads this version's bytes: the push's other leases stay until it ends
                for lease in segments.leases.values():
                    if id(lease) not in held:
                        segments.keep(lease)
                        self._unheld.append(lease)

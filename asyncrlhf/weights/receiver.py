"""The receiving side of a push: stage, verify, atomic swap.

A `WeightReceiver` takes one push at a time. It reads each message's bytes through the `Source` of the route
that carried them (`routes.py`: shared memory, data channel, or the gRPC stream itself), stages and verifies
every tensor against the live model (`WeightTarget.named_tensors`: name, shape, dtype) and its checksum, and
only on the commit message hands the complete set to `WeightTarget.apply_weights` with the `PolicyVersion`
it verified: the atomic swap. Any problem raises `PushRejected` before anything live is touched, so the
target keeps serving its previous version bit for bit. Nothing read from the wire is unpickled: tensors are
raw bytes viewed with a known dtype.
"""

from __future__ import annotations

import contextlib
import threading
import time
from collections.abc import Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass

import torch

from asyncrlhf._proto import weights_pb2 as pb
from asyncrlhf.version import PolicyVersion
from asyncrlhf.weights.channel import DataListener, DataSource
from asyncrlhf.weights.codec import FROM_WIRE, Snapshot, version_of
from asyncrlhf.weights.collective_member import CollectiveSource, Member
from asyncrlhf.weights.delta_receive import Bases, DeltaStaging
from asyncrlhf.weights.leases import Buffers, Holds
from asyncrlhf.weights.routes import Payload, Source
from asyncrlhf.weights.shm_read import ShmSource
from asyncrlhf.weights.staging import Elsewhere, InPlace, Staging
from asyncrlhf.weights.stream import StreamSource
from asyncrlhf.weights.target import WeightTarget
from asyncrlhf.weights.vocabulary import PushRejected, Reason

NO_VERSION = PolicyVersion(0, 0)  # a generator after a start: nothing pushed yet


@dataclass(frozen=True)
class PushResult:
    # The committed tensors as received (wire dtype, the checksums verified), in the order sent: what a relay
    # forwards. Their bytes stay as committed only while the receiver is held (`WeightReceiver.hold`).
    snapshot: Snapshot
    bytes: int
    apply_seconds: float
    tensor_count: int

    @property
    def relayable(self) -> bool:
        """Whether every tensor's bytes are here to forward (none in an engine's worker: `engine_member`)."""
        return len(self.snapshot.tensors) == self.tensor_count


@dataclass(frozen=True)
class ReceiverStatus:
    version: PolicyVersion
    updated_at: float
    tensor_count: int


class VersionOrder:
    """The version served, and the rule a push must pass: newer than it (`PolicyVersion.newer_than`: a newer
    lineage at any step, since a restarted learner resumes from a checkpoint at a lower step), the same on
    every message of the push."""

    def __init__(self, served: PolicyVersion):
        self.served, self.updated_at = served, 0.0

    def check(self, header: pb.WeightChunk, pushed: PolicyVersion | None) -> PolicyVersion:
        """The version of the push `header` belongs to (`pushed`: as its first message said, None on it)."""
        version = version_of(header)
        if pushed is None:
            if version.lineage < self.served.lineage:
                raise PushRejected(Reason.STALE_LINEAGE,
                                   f"lineage {version.lineage} is older than the lineage "
                                   f"{self.served.lineage} served (a learner that was replaced?)")
            if not version.newer_than(self.served):
                raise PushRejected(Reason.STALE_VERSION, f"version {version.step} is not newer than "
                                                         f"{self.served}")
            return version
        if version != pushed:
            raise PushRejected(Reason.STALE_VERSION,
                               f"the version changed mid-push from {pushed} to {version}")
        return pushed

    def serve(self, version: PolicyVersion) -> None:
        self.served, self.updated_at = version, time.time()


def _as_pairs(messages: Iterable) -> Iterator[tuple[pb.WeightChunk, memoryview]]:
    for message in messages:
        yield message if isinstance(message, tuple) else (message, memoryview(message.data))


def _payloads(messages: Iterable[tuple[pb.WeightChunk, memoryview]], sources: Sequence[Source],
              ) -> Iterator[tuple[pb.WeightChunk, Payload]]:
    """Each message with its bytes, from the first source that claims it (the stream claims any)."""
    for header, inline in messages:
        source = next(s for s in sources if s.claims(header))
        yield header, source.payload(header, inline)


class WeightReceiver:
    """Stages pushes and applies each atomically on commit; pushes are handled one at a time. `data`: the
    data channel pushes may send their bytes over (`channel.DataListener`); `collective`: the weight groups
    pushes may broadcast their bytes to (`collective_member.CollectiveMember`; `engine_member.EngineMember`
    when an inference engine's worker receives them). Byte pushes are staged into `Buffers` kept between
    pushes; same-host pushes are verified and adopted where they lie, the segment leases kept by `Holds` for
    as long as a live tensor views them or a relay reads them."""

    def __init__(self, target: WeightTarget, version: PolicyVersion = NO_VERSION,
                 data: DataListener | None = None, collective: Member | None = None):
        self.target, self.data, self.collective = target, data, collective
        self.order = VersionOrder(version)
        self.buffers = Buffers()
        self.holds = Holds()
        self.bases = Bases()  # the version served, kept when its push asked: what a delta applies onto
        self._lock = threading.Lock()

    @property
    def version(self) -> PolicyVersion:
        return self.order.served

    def status(self) -> ReceiverStatus:
        return ReceiverStatus(self.order.served, self.order.updated_at, len(self.target.named_tensors()))

    def hold(self) -> None:
        """Keep the bytes of the version being received (or last committed) as they are until `release`: the
        snapshot of its `PushResult` stays valid. May be called from inside `receive` (while consuming the
        messages)."""
        self.holds.hold()

    def release(self) -> None:
        self.holds.release()

    def receive(self, messages: Iterable[tuple[pb.WeightChunk, memoryview] | pb.WeightChunk]) -> PushResult:
        """Consume one push of (header, inline bytes) pairs (see `decode_chunk`) or plain WeightChunks; raise
        `PushRejected` (old weights intact) or return once the new version is live."""
        with self._lock:
            try:
                with ShmSource(self.holds.maps) as segments, DataSource(self.data) as data, \
                        CollectiveSource(self.collective) as collective:
                    sources = (segments, data, collective, StreamSource())
                    return self._receive(_payloads(_as_pairs(messages), sources), segments)
            finally:
                self.holds.prune()

    def _receive(self, messages: Iterable[tuple[pb.WeightChunk, Payload]], segments: ShmSource,
                 ) -> PushResult:
        if self.holds.held:  # a relay still reads the buffers of a version: stage into new ones
            self.buffers.renew()
        live = self.target.named_tensors()
        staged: dict[str, torch.Tensor] = {}
        done: list[Staging | InPlace | Elsewhere] = []
        current: Staging | InPlace | Elsewhere | None = None
        version: PolicyVersion | None = None
        received = 0
        try:
            for header, payload in messages:
                version = self.order.check(header, version)
                if current is not None and (header.commit or header.name != current.name):
                    staged[current.name] = current.finish()
                    done.append(current)
                    current = None
                if header.commit:
                    return self._commit(header, version, staged, received, done, segments)
                if current is None:
                    current = self._start(header, payload, live, staged)
                current.add(header, payload)
                received += payload.nbytes
        except BaseException:
            if current is not None:  # no copy may still write into a buffer the next push reuses:
                current.abort()  # a read from the data channel stops at once (its error is this one's)
                with contextlib.suppress(Exception):
                    current.wait()
            raise
        if current is not None:
            current.wait()
        where = f" in `{current.name}`" if current is not None else ""
        raise PushRejected(Reason.TRUNCATED, f"the stream ended before the commit message{where}")

    def _start(self, header: pb.WeightChunk, payload: Payload, live: Mapping[str, torch.Tensor],
               staged: Mapping) -> Staging | InPlace | Elsewhere:
        name = header.name
        if name not in live:
            raise PushRejected(Reason.UNKNOWN_TENSOR, f"`{name}` is not a tensor of this model")
        if name in staged:
            raise PushRejected(Reason.DUPLICATE_TENSOR, f"`{name}` was sent twice in one push")
        target = live[name]
        if tuple(header.shape) != tuple(target.shape):
            raise PushRejected(Reason.SHAPE_MISMATCH,
                               f"`{name}`: pushed {list(header.shape)}, live {list(target.shape)}")
        wire = FROM_WIRE.get(header.dtype)
        castable = wire is not None and wire.is_floating_point and target.dtype.is_floating_point
        if wire is None or (wire != target.dtype and not castable):
            raise PushRejected(Reason.DTYPE_MISMATCH,
                               f"`{name}`: pushed {pb.DType.Name(header.dtype)}, live {target.dtype}")
        nbytes = target.numel() * wire.itemsize
        if header.HasField("delta"):
            base = self.bases.base(header, wire, nbytes)
            return DeltaStaging(header, base, self.buffers.get(name, nbytes), self.buffers.worker)
        holder = payload.elsewhere()
        if holder is not None:
            return Elsewhere(header, nbytes, holder)
        lent = payload.lend()
        if lent is not None:
            return InPlace(header, nbytes, lent, self.buffers.worker)
        return Staging(header, self.buffers.get(name, nbytes), self.buffers.worker)

    def _commit(self, header: pb.WeightChunk, version: PolicyVersion, staged: dict[str, torch.Tensor],
                received: int, done: list[Staging | InPlace | Elsewhere], segments: ShmSource) -> PushResult:
        if header.tensor_count != len(staged):
            raise PushRejected(Reason.TENSOR_COUNT,
                               f"commit says {header.tensor_count} tensors, received {len(staged)}")
        missing = set(self.target.named_tensors()) - set(staged)
        if missing and not header.partial:
            example = min(missing)
            raise PushRejected(Reason.MISSING_TENSORS,
                               f"{len(missing)} live tensors not sent (e.g. `{example}`); mark the commit "
                               "partial to update only some")
        for holder in {id(s.holder): s.holder for s in done if isinstance(s, Elsewhere)}.values():
            holder.arrived()
        start = time.perf_counter()
        replaced = self.target.apply_weights(staged, version, adopt=True) or {}
        here = [s for s in done if not isinstance(s, Elsewhere)]
        self.holds.rebind(replaced, here, segments, self.buffers)
        # bytes held elsewhere (an engine's worker) are neither a delta's base nor a relay's to forward
        self.bases.keep(version, header.keep_base and len(here) == len(done), here, replaced, self.buffers)
        self.order.serve(version)
        snapshot = Snapshot(version, tuple(s.wire() for s in here), header.partial)
        return PushResult(snapshot, received, time.perf_counter() - start, len(done))

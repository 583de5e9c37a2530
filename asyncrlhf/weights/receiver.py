"""The receiving side of a push: stage, verify, atomic swap.

A `WeightReceiver` takes one push at a time. It reads each message's bytes through the `Source` of the
registered route that carried them (`routes.py`), stages and verifies every tensor against the live model
(`WeightTarget.named_tensors`: name, shape, dtype) and its checksum, and only on the commit message hands the
complete set to `WeightTarget.apply_weights` with the `PolicyVersion` it verified: the atomic swap. Any
problem raises `PushRejected` before anything live is touched, so the target keeps serving its previous
version bit for bit. Nothing read from the wire is unpickled: tensors are raw bytes viewed with a known dtype.

Bytes to copy are staged by `staging.Staging` (into `staging.Buffers` kept between pushes); bytes adopted
where they lie (a same-host segment) are `leases.InPlace`; bytes another process holds stage a placeholder
(`staging.Elsewhere`); a delta is `delta.DeltaStaging`, entered only by a push that sends one.
"""

from __future__ import annotations

import contextlib
import threading
import time
from collections.abc import Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from asyncrlhf._proto import weights_pb2 as pb
from asyncrlhf.version import PolicyVersion
from asyncrlhf.weights.codec import (
    FROM_WIRE,
    Snapshot,
    nbytes_of,
    version_of,
)
from asyncrlhf.weights.delta import Bases, DeltaStaging
from asyncrlhf.weights.leases import Holds, InPlace
from asyncrlhf.weights.routes import HeldBytes, InPlaceBytes, Payload, Source, registered
from asyncrlhf.weights.staging import Buffers, Elsewhere, Staging
from asyncrlhf.weights.target import WeightTarget
from asyncrlhf.weights.vocabulary import PushRejected, Reason, Route

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
        """Whether every tensor's bytes are here to forward (none in an engine's worker:
        `sampling.hops.engine_member`)."""
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


Stage = Staging | InPlace | DeltaStaging | Elsewhere


def _as_pairs(messages: Iterable) -> Iterator[tuple[pb.WeightChunk, memoryview]]:
    for message in messages:
        yield message if isinstance(message, tuple) else (message, memoryview(message.data))


class _Sources:
    """The sources of one push, each opened when a message first comes by its route (the first registered
    route that claims it; the route of last resort claims any): a push opens its own route's alone."""

    def __init__(self, stack: contextlib.ExitStack, ends: Mapping[Route, Any]):
        self._stack, self._ends, self._specs = stack, ends, registered()
        self._open: dict[Route, Source] = {}

    def payloads(self, messages: Iterable[tuple[pb.WeightChunk, memoryview]],
                 ) -> Iterator[tuple[pb.WeightChunk, Payload]]:
        for header, inline in messages:
            spec = next(s for s in self._specs if s.claims(header))
            source = self._open.get(spec.route)
            if source is None:
                source = self._stack.enter_context(spec.source(self._ends.get(spec.route)))
                self._open[spec.route] = source
            yield header, source.payload(header, inline)


class WeightReceiver:
    """Stages pushes and applies each atomically on commit; pushes are handled one at a time. `ends`: the
    generator's standing end of a route, by the route's name (`data`: a `channel_read.DataListener`;
    `collective`: the weight groups it joins, `collective_member.CollectiveMember`, or
    `sampling.hops.engine_member.EngineMember` when an inference engine's worker receives them); a route with
    a `standing` end of its own gets one made here. Byte pushes are staged into `Buffers` kept between pushes;
    same-host pushes are verified and adopted where they lie, the leases kept by `Holds` for as long as a live
    tensor views them or a relay reads them."""

    def __init__(self, target: WeightTarget, version: PolicyVersion = NO_VERSION, **ends: Any):
        self.target = target
        self.ends: dict[Route, Any] = {Route(name): end for name, end in ends.items() if end is not None}
        routes = {spec.route: spec for spec in registered()}
        unknown = set(self.ends) - set(routes)
        if unknown:
            names = ", ".join(sorted(r.value for r in unknown))
            raise ValueError(f"no route named {names} is registered; the routes are: "
                             f"{', '.join(r.value for r in routes)}")
        for spec in routes.values():
            if spec.standing is not None and spec.route not in self.ends:
                self.ends[spec.route] = spec.standing()
        self.order = VersionOrder(version)
        self.buffers = Buffers()
        self.holds = Holds()
        self.bases: Bases | None = None  # the version served, kept when its push asked: a delta's base
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
        with self._lock, contextlib.ExitStack() as stack:
            return self._receive(_Sources(stack, self.ends).payloads(_as_pairs(messages)))

    def _receive(self, messages: Iterable[tuple[pb.WeightChunk, Payload]]) -> PushResult:
        if self.holds.held:  # a relay still reads the buffers of a version: stage into new ones
            self.buffers.renew()
        live = self.target.named_tensors()
        staged: dict[str, torch.Tensor] = {}
        done: list[Stage] = []
        current: Stage | None = None
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
                    return self._commit(header, version, staged, received, done)
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
               staged: Mapping) -> Stage:
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
            base = (self.bases or Bases()).base(header, wire, nbytes)
            delta = Staging(header, torch.empty(nbytes_of(header), dtype=torch.uint8), self.buffers.worker)
            return DeltaStaging(header, delta, base, self.buffers.get(name, nbytes))
        if isinstance(payload, HeldBytes):
            return Elsewhere(header, nbytes, payload.holder)
        if isinstance(payload, InPlaceBytes):
            return InPlace(header, nbytes, payload, self.buffers.worker)
        return Staging(header, self.buffers.get(name, nbytes), self.buffers.worker)

    def _commit(self, header: pb.WeightChunk, version: PolicyVersion, staged: dict[str, torch.Tensor],
                received: int, done: list[Stage]) -> PushResult:
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
        self._rebuffer(replaced, here)
        if header.keep_base or self.bases is not None:  # a delta push, or the first push after one
            self.bases = self.bases or Bases()
            # bytes held elsewhere (an engine's worker) are neither a delta's base nor a relay's to forward
            keep = header.keep_base and len(here) == len(done)
            self.bases.keep(version, keep, here, replaced, self.buffers)
            self.bases = self.bases if self.bases.version is not None else None
        self.order.serve(version)
        snapshot = Snapshot(version, tuple(s.wire() for s in here), header.partial)
        return PushResult(snapshot, received, time.perf_counter() - start, len(done))

    def _rebuffer(self, replaced: Mapping[str, torch.Tensor],
                  here: Sequence[Staging | InPlace | DeltaStaging]) -> None:
        """After a swap: stage the next push of each replaced tensor into the storage the model let go of,
        unless that storage viewed a segment (`Holds.rebind`: the leases live tensors view)."""
        leased = self.holds.leasing or any(s.lease is not None for s in here)
        viewed = self.holds.rebind(replaced, here) if leased else set()
        for s in here:
            if s.name not in replaced:
                continue  # copied into the live storage, which keeps whatever backs it
            if s.name not in viewed:  # the replaced storage is the receiver's own: reuse it
                self.buffers.reuse(s.name, replaced[s.name])
            elif s.lease is None:  # its buffer is live now, and the replaced one viewed a segment
                self.buffers.drop(s.name)

"""The generator end of the collective route (`Route.COLLECTIVE`): the weight groups a receiver joins and the
buckets it receives (`collective.py` says how a round goes).

`CollectiveMember` lives as long as the generator's WeightSync server: the groups it is in (by id, the last
`KEPT_GROUPS`) and its bucket buffers. A push's first tensor message says the member is here for the round
(before the receiver judges the push) and starts a `MemberRound`, which takes part in the whole round on a
thread of its own whatever the receiver decides, so a refused push never stalls the others: it waits for the
learner's verdict and receives every bucket, at most `IN_FLIGHT` ahead of the receiver's reads (two
buffers), draining the rest once the receiver stops reading.
`CollectiveSource` is the route's `Source` for one push: each tensor's `InBucket` payload checks its bucket's
XXH3-64, computed on the bucket as received (in host memory; after a copy from the GPU with NCCL), against
the learner's, then copies the tensor's bytes into staging, hashing them there (the per-tensor checksum).
The route is registered at the end of this module, with its learner end (`collective_sender.py`).
"""

from __future__ import annotations

import datetime
import functools
import threading
from typing import Protocol

import numpy as np
import xxhash

from asyncrlhf._proto import weights_pb2 as pb
from asyncrlhf.weights.codec import copy_hashed, nbytes_of
from asyncrlhf.weights.collective import (
    GO,
    IN_FLIGHT,
    JOIN_TIMEOUT_S,
    Group,
    Kept,
    backends_of,
    broadcast,
    device_of,
    go_key,
    here_key,
    store_client,
)
from asyncrlhf.weights.collective_sender import CollectiveSender
from asyncrlhf.weights.routes import Fallback, Payload, RouteSpec, SenderSettings, register
from asyncrlhf.weights.vocabulary import PushRejected, Reason, Route


class Round(Protocol):
    """One round as a receiver reads it: its slot, and each tensor message's bytes."""

    slot: pb.CollectiveSlot

    def payload(self, header: pb.WeightChunk) -> Payload: ...

    def close(self) -> None:
        """The receiver reads no more."""


class Member(Protocol):
    """What a receiver joins rounds through: a `CollectiveMember` (this process receives the buckets) or an
    `sampling.hops.engine_member.EngineMember` (its inference engine's worker does)."""

    backends: tuple[str, ...]

    def round(self, slot: pb.CollectiveSlot) -> Round: ...

    def close(self) -> None: ...


class MemberRound:
    """One round's buckets as received by this member, on a thread of its own (see the module)."""

    def __init__(self, member: CollectiveMember, slot: pb.CollectiveSlot, group: Group,
                 previous: MemberRound | None):
        self.member, self.slot, self.group, self.sizes = member, slot, group, tuple(slot.bucket_bytes)
        self._previous = previous
        self._buckets: dict[int, tuple[np.ndarray, int]] = {}  # k -> (bytes, XXH3-64), the last IN_FLIGHT
        self._received = self._read = 0  # buckets received; the receiver reads bucket `_read` or later
        self._closed = False
        self._error = ""
        self._cond = threading.Condition()
        self._thread = threading.Thread(target=self._run, name="weight-collective-member", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        group = self.group
        try:
            wait = min(JOIN_TIMEOUT_S, group.timeout_s) + 5.0
            group.keys.wait([go_key(self.slot.round)], datetime.timedelta(seconds=wait))
            if group.keys.get(go_key(self.slot.round)) != GO.encode():
                return self._fail("the learner abandoned the round: a member of the group did not join it")
            if self._previous is not None:  # its thread ends within the group's timeouts: the ring is free
                self._previous.join()
                self._previous = None
            self._receive(group)
        except (RuntimeError, OSError, ValueError) as err:  # the learner went away, a peer died, a timeout
            self.member.groups.drop(group.id, group)
            self._fail(f"the broadcast failed: {err}")

    def _receive(self, group: Group) -> None:
        process_group = group.built()
        device = device_of(group.backend, self.member.device)
        ring = self.member.groups.ring(max(self.sizes, default=0), device)
        for k, size in enumerate(self.sizes):
            with self._cond:
                self._cond.wait_for(functools.partial(self._room_for, k))
            bucket = ring[k % IN_FLIGHT][:size]
            if size:
                broadcast(process_group, bucket).wait()
            held = (bucket if device.type == "cpu" else bucket.cpu()).numpy()
            checksum = xxhash.xxh3_64_intdigest(memoryview(held))  # type: ignore[arg-type]  # where they lie
            with self._cond:
                self._buckets[k] = (held, checksum)
                self._buckets.pop(k - IN_FLIGHT, None)
                self._received = k + 1
                self._cond.notify_all()

    def _room_for(self, k: int) -> bool:
        """Bucket k may be received: the receiver reads no more, or reads one of the buckets before it."""
        return self._closed or k - self._read < IN_FLIGHT

    def _fail(self, why: str) -> None:
        with self._cond:
            self._error = why
            self._cond.notify_all()

    def bucket(self, k: int) -> tuple[np.ndarray, int]:
        """Bucket k's bytes and the XXH3-64 computed on them, once received. Reading it lets the buckets
        before it be overwritten: a push reads its buckets in order."""
        with self._cond:
            self._cond.wait_for(lambda: self._received > k or self._error != "" or self._closed)
            if k < self._read or k not in self._buckets:
                if self._received > k:
                    raise PushRejected(Reason.BAD_OFFSET, f"bucket {k} was read past: a push's tensors "
                                                          "come in the order of their buckets")
                raise PushRejected(Reason.COLLECTIVE_UNAVAILABLE,
                                   f"{self._error or 'the push ended'} (round {self.slot.round}); push over "
                                   "the gRPC stream")
            self._read = k
            self._cond.notify_all()
            return self._buckets[k]

    def payload(self, header: pb.WeightChunk) -> InBucket:
        return InBucket(self, header)

    def close(self) -> None:
        """The receiver reads no more: the rest of the round is drained."""
        with self._cond:
            self._closed = True
            self._cond.notify_all()

    def join(self) -> None:
        self._thread.join()


class InBucket:
    """One tensor's bytes in a bucket of the round (a `Payload`)."""

    def __init__(self, round_: MemberRound, header: pb.WeightChunk):
        self.round, self.name, self.where = round_, header.name, header.collective
        self.nbytes = nbytes_of(header)

    def copy_into(self, dst: np.ndarray, digest: xxhash.xxh3_64) -> None:
        k, offset = self.where.bucket, self.where.bucket_offset
        if k >= len(self.round.sizes) or offset + self.nbytes > self.round.sizes[k]:
            raise PushRejected(Reason.BAD_OFFSET, f"`{self.name}`: {self.nbytes} bytes at {offset} of bucket "
                                                  f"{k} lie outside the round's buckets")
        bucket, checksum = self.round.bucket(k)
        if checksum != self.where.bucket_checksum:
            raise PushRejected(Reason.BAD_CHECKSUM,
                               f"`{self.name}`: bucket {k} as received has XXH3-64 {checksum:#018x}, the "
                               f"learner packed {self.where.bucket_checksum:#018x}")
        copy_hashed(dst, memoryview(bucket[offset:offset + self.nbytes]), digest)  # type: ignore[arg-type]

    def abort(self) -> None:
        self.round.close()


class CollectiveSource:
    """The generator end of `Route.COLLECTIVE` for one push: the tensor messages that name a bucket, all of
    one round. Use as a context manager: the round is drained when the push ends, whatever the outcome."""

    route = Route.COLLECTIVE

    def __init__(self, member: Member | None):
        self.member = member
        self.round: Round | None = None

    def payload(self, header: pb.WeightChunk, inline: memoryview) -> Payload:
        slot = header.collective
        if self.member is None:
            raise PushRejected(Reason.COLLECTIVE_UNAVAILABLE, "this receiver joins no weight group (its "
                                                              "GetStatus offers none); push over the stream")
        if self.round is None:
            self.round = self.member.round(slot)
        elif (slot.group, slot.round) != (self.round.slot.group, self.round.slot.round):
            raise PushRejected(Reason.COLLECTIVE_UNAVAILABLE, "a push's tensors are all in one round")
        return self.round.payload(header)

    def __enter__(self) -> CollectiveSource:
        return self

    def __exit__(self, *exc: object) -> None:
        if self.round is not None:
            self.round.close()


class CollectiveMember:
    """What a generator keeps to join weight groups: `device`, where its buckets are received (a GPU: NCCL
    offered too)."""

    def __init__(self, device: str = "cpu"):
        self.device = device
        self.backends = backends_of(device)
        self.groups = Kept()  # by id
        self._last: MemberRound | None = None
        self._lock = threading.Lock()

    def round(self, slot: pb.CollectiveSlot) -> MemberRound:
        """Take part in the round `slot` names (after the previous one ends)."""
        if slot.backend not in self.backends:
            raise PushRejected(Reason.COLLECTIVE_UNAVAILABLE, f"backend {slot.backend!r} is not one this "
                                                              f"receiver offers ({', '.join(self.backends)})")
        try:  # said before the receiver judges the push: a refused push still takes part in the round
            group = self.group(slot)
            group.keys.set(here_key(slot.round, slot.rank), GO)
        except (RuntimeError, OSError, ValueError) as err:
            raise PushRejected(Reason.COLLECTIVE_UNAVAILABLE, f"cannot join the learner's weight group at "
                                                              f"{slot.store}: {err}") from err
        with self._lock:
            self._last = MemberRound(self, slot, group, self._last)
            return self._last

    def group(self, slot: pb.CollectiveSlot) -> Group:
        """The group `slot` names: the learner's store, this member's rank."""
        timeout_s = slot.timeout_ms / 1000
        return self.groups.group(slot.group, lambda: Group(
            store_client(slot.store, min(JOIN_TIMEOUT_S, timeout_s)), slot.group, slot.rank, slot.world_size,
            slot.backend, timeout_s))

    def close(self) -> None:
        """Leave every group (their connections close: the learner's ops with this member fail at once)."""
        self.groups.clear()
        with self._lock:
            last, self._last = self._last, None
        if last is not None:
            last.close()


def _sender(settings: SenderSettings) -> CollectiveSender | None:
    """With learner.collective, the route the learner prefers."""
    if settings.cfg is None or not settings.cfg.learner.collective:
        return None
    return CollectiveSender.from_config(settings.cfg, settings.access)


def _offer(member: Member | None, status: pb.GetStatusReply) -> None:
    if member is not None:
        status.collective_backends.extend(member.backends)


# One broadcast serves every member of a round: the version whole (`whole`). A round the receiver cannot take
# part in, or a store the pusher cannot reach, may heal: ask again at the next push.
register(RouteSpec(Route.COLLECTIVE, _sender, lambda header: header.HasField("collective"), CollectiveSource,
                   preference=10, offer=_offer, whole=True,
                   by_config=True,
                   fallbacks={Reason.COLLECTIVE_UNAVAILABLE: Fallback(avoid=False),
                              OSError: Fallback(avoid=False)}))

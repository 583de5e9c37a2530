"""Routes: the one interface every way of moving a push's bytes implements, at both ends, and how the pusher
picks one per generator.

Every route keeps gRPC for the control of a push (each tensor's name, shape, dtype; the version; the commit)
and for its refusals, so version order, auth and "a refused push keeps the old version serving" hold on each;
routes differ only in where the tensor bytes travel. Like veRL's checkpoint engine, a route is a pair:

- learner end, a `Sender`: `accepts` a generator by its GetStatus, and `begin`s a `Transfer` of one version
  for the targets of one round (the version written or encoded once for all of them); the transfer's
  `send_weights` makes one target's PushWeights call.
- generator end, a `Source`: `claims` the messages of its route and gives each its `Payload`, the tensor's
  bytes wherever the route put them, which the receiver copies (`copy_into`) or adopts in place (`lend`).

A new route is one more Sender/Source pair, a row in `FALLBACKS` if it has one, and a row in the route
contract suite (tests/integration/weights/test_route_contract.py), as the collective broadcast
(`collective_sender.CollectiveSender` / `collective_member.CollectiveSource`) is. The relay tree
(`Route.RELAY`) is chosen by the learner's publisher: its bytes reach each generator over a route of the
relaying generator's pusher.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Protocol

import grpc
import numpy as np
import xxhash

from asyncrlhf._proto import weights_pb2 as pb
from asyncrlhf.weights.access import UNREACHABLE, PushCall
from asyncrlhf.weights.codec import Snapshot
from asyncrlhf.weights.vocabulary import Reason, Route


class Transfer(Protocol):
    """One version on one route, for the targets of one round."""

    def send_weights(self, call: PushCall, address: str, commit: bytes) -> pb.PushReply:
        """One target's push: the route's bytes and control messages, then `commit` (the serialized commit
        message: it may carry that target's part of a relay tree); raises grpc.RpcError when refused, OSError
        when the route's own connection cannot be made."""

    def close(self) -> None:
        """Every target's call has ended."""


class Sender(Protocol):
    """The learner end of a route."""

    route: Route

    def accepts(self, address: str, status: pb.GetStatusReply) -> bool:
        """Whether the generator at `address`, which answered `status`, can take this route."""

    def forget(self, address: str) -> None:
        """`address` no longer takes this route (it fell back, or will be asked again)."""

    def begin(self, push: Snapshot, targets: int) -> Transfer:
        """Prepare `push` for `targets` targets of one round (0: targets that fell back to this route)."""

    def close(self) -> None:
        """Release what the sender holds across rounds."""


class Lease(Protocol):
    """A receiver's hold on bytes it adopts where they lie (a shared-memory segment's), released once no live
    tensor views them and no relay reads them."""

    name: str
    reused: bool  # seen through a mapping kept from an earlier version: a failed checksum is read again

    def populate(self, start: int, n: int) -> None: ...

    def refreshed(self, start: int, n: int) -> memoryview: ...

    def release(self) -> None: ...


@dataclass(frozen=True)
class InPlaceBytes:
    """A tensor's bytes to verify and adopt where they lie: `view`, at `start` of the `lease`'s bytes."""

    view: memoryview
    start: int
    lease: Lease


class Holder(Protocol):
    """Another process that holds a push's bytes and verifies them at the commit: the receiver describes each
    tensor to it as the tensor's message passes the receiver's checks."""

    def describe(self, header: pb.WeightChunk) -> None: ...

    def arrived(self) -> None:
        """Wait until it holds every byte of the push (raises `PushRejected`): the receiver asks at the
        commit, before the target takes its backend, so the swap waits on the load alone, not on the
        transport."""


class Payload(Protocol):
    """The bytes of one tensor message, wherever its route put them."""

    nbytes: int

    def copy_into(self, dst: np.ndarray, digest: xxhash.xxh3_64) -> int | None:
        """Copy the bytes into `dst` (a uint8 array of `nbytes`), updating `digest` over them as stored;
        the checksum they came with, or None (the message's own)."""

    def lend(self) -> InPlaceBytes | None:
        """The bytes where they lie, to verify and adopt with no copy, or None: copy them."""

    def elsewhere(self) -> Holder | None:
        """Where the bytes stay, in another process that verifies them at the commit (an engine's worker:
        `engine_member.EngineRound`), or None: they are here."""

    def abort(self) -> None:
        """The push is refused: stop a copy in progress."""


class Source(Protocol):
    """The generator end of a route, for one push."""

    route: Route

    def claims(self, header: pb.WeightChunk) -> bool:
        """Whether this message's bytes came by this route."""

    def payload(self, header: pb.WeightChunk, inline: memoryview) -> Payload:
        """The message's bytes (`inline`: those inside the gRPC message)."""


@dataclass(frozen=True)
class Fallback:
    """What a push that failed on a route does: take route `to` now; `avoid`: keep off the failed route for
    that generator from now on (else ask it again at the next push: a restart may have moved it)."""

    to: Route
    avoid: bool


# (route, what failed: the receiver's refusal, or the route's own connection) -> what to do instead
FALLBACKS: dict[tuple[Route, Reason | type[OSError]], Fallback] = {
    (Route.SHM, Reason.SHM_UNAVAILABLE): Fallback(Route.STREAM, avoid=True),
    (Route.DATA, Reason.CHANNEL_UNAVAILABLE): Fallback(Route.STREAM, avoid=True),
    (Route.DATA, OSError): Fallback(Route.STREAM, avoid=False),
    (Route.COLLECTIVE, Reason.COLLECTIVE_UNAVAILABLE): Fallback(Route.STREAM, avoid=False),
    (Route.COLLECTIVE, OSError): Fallback(Route.STREAM, avoid=False),
}


@dataclass(frozen=True)
class Unreachable:
    """A generator that did not answer GetStatus: the push would get no answer either."""

    code: str  # the gRPC status code name


class Routes:
    """Which route each generator gets: the first of `senders` (in order of preference) that accepts it,
    by its GetStatus, asked once per address; routes it fell back from are avoided from then on."""

    def __init__(self, senders: Sequence[Sender], get_status: Callable[[str], pb.GetStatusReply]):
        self.senders = {s.route: s for s in senders}
        self._get_status = get_status
        self._status: dict[str, pb.GetStatusReply] = {}
        self._avoid: dict[str, set[Route]] = {}

    def route(self, address: str) -> Route | Unreachable:
        if len(self.senders) == 1:
            return next(iter(self.senders))
        status = self._status.get(address)
        if status is None:
            try:
                status = self._status[address] = self._get_status(address)
            except grpc.RpcError as err:
                return Unreachable(err.code().name) if err.code() in UNREACHABLE else Route.STREAM
        avoid = self._avoid.get(address, set())
        return next((route for route, sender in self.senders.items()
                     if route not in avoid and sender.accepts(address, status)), Route.STREAM)

    def fall_back(self, address: str, failed: Route, fallback: Fallback) -> None:
        self.senders[failed].forget(address)
        if fallback.avoid:
            self._avoid.setdefault(address, set()).add(failed)
        else:
            self._status.pop(address, None)

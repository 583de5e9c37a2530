"""Routes: the one interface every way of moving a push's bytes implements, at both ends, and the registry
of routes (`register`), which the pusher and the receiver read: neither names a route.

Every route keeps gRPC for the control of a push (each tensor's name, shape, dtype; the version; the commit)
and for its refusals, so version order, auth and "a refused push keeps the old version serving" hold on each;
routes differ only in where the tensor bytes travel. Like veRL's checkpoint engine, a route is a pair:

- learner end, a `Sender`: `accepts` a generator by its GetStatus, and `begin`s a `Transfer` of one version
  for the targets of one round (the version written or encoded once for all of them); the transfer's
  `send_weights` makes one target's PushWeights call.
- generator end, a `Source`, opened for a push when a message its spec `claims` first comes: it gives each
  message of its route its `Payload`, the tensor's bytes wherever the route put them: `Bytes` the receiver
  copies, `InPlaceBytes` it verifies and adopts where they lie, or `HeldBytes` another process holds and
  verifies at the commit.

A new route is one module that registers a `RouteSpec`: its two ends, the generator's standing end (what
GetStatus offers of it), and its rules (whole versions only, what a failure gives way to). The route contract
suite (tests/integration/weights/test_route_contract.py) runs over every registered route. The relay tree
(`Route.RELAY`) is chosen by the learner's publisher: its bytes reach each generator over a route of the
relaying generator's pusher.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from contextlib import AbstractContextManager
from dataclasses import dataclass, field
from typing import Any, Protocol

import grpc
import numpy as np
import xxhash

from asyncrlhf._proto import weights_pb2 as pb
from asyncrlhf.weights.access import ClientAccess, PushCall, ServerAccess
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

    def keep(self) -> None:
        """The receiver holds the lease past the push (live tensors view its bytes) and releases it."""

    def populate(self, start: int, n: int) -> None: ...

    def refreshed(self, start: int, n: int) -> memoryview: ...

    def release(self) -> None: ...


@dataclass(frozen=True)
class InPlaceBytes:
    """A tensor's bytes to verify and adopt where they lie: `view`, at `start` of the `lease`'s bytes."""

    view: memoryview
    start: int
    lease: Lease

    @property
    def nbytes(self) -> int:
        return len(self.view)


class Holder(Protocol):
    """Another process that holds a push's bytes and verifies them at the commit: the receiver describes each
    tensor to it as the tensor's message passes the receiver's checks."""

    def describe(self, header: pb.WeightChunk) -> None: ...

    def arrived(self) -> None:
        """Wait until it holds every byte of the push (raises `PushRejected`): the receiver asks at the
        commit, before the target takes its backend, so the swap waits on the load alone, not on the
        transport."""


class Bytes(Protocol):
    """The bytes of one tensor message to copy (inline, from a connection, from a broadcast bucket)."""

    nbytes: int

    def copy_into(self, dst: np.ndarray, digest: xxhash.xxh3_64) -> int | None:
        """Copy the bytes into `dst` (a uint8 array of `nbytes`), updating `digest` over them as stored;
        the checksum they came with, or None (the message's own)."""

    def abort(self) -> None:
        """The push is refused: stop a copy in progress."""


@dataclass(frozen=True)
class HeldBytes:
    """The bytes of one tensor message, kept in another process that verifies them at the commit."""

    nbytes: int
    holder: Holder


Payload = Bytes | InPlaceBytes | HeldBytes  # the bytes of one tensor message, wherever its route put them


class Source(Protocol):
    """The generator end of a route, for one push."""

    route: Route

    def payload(self, header: pb.WeightChunk, inline: memoryview) -> Payload:
        """The message's bytes (`inline`: those inside the gRPC message)."""


@dataclass(frozen=True)
class Fallback:
    """What a push that failed on a route does: take route `to` now (None: the route of last resort);
    `avoid`: keep off the failed route for that generator from now on (else ask it again at the next push: a
    restart may have moved it)."""

    avoid: bool
    to: Route | None = None


@dataclass(frozen=True)
class SenderSettings:
    """What a route's learner end is made from: the pusher's access, chunk size and deadline, and the run's
    `Config` when the pusher was made from one (None: a route that needs one is not offered)."""

    access: ClientAccess
    chunk_bytes: int
    timeout_s: float
    cfg: Any = None


def _nothing(end: Any, *args: Any) -> None:
    """A route with nothing to offer in GetStatus, or nothing to check beside the server's access."""


@dataclass(frozen=True)
class RouteSpec:
    """One route, as the pusher and the receiver use it.

    `sender`: its learner end, or None where this process cannot take it. `claims`: whether a message's bytes
    came by the route. `source`: its generator end for one push, given the generator's standing end of the
    route (None when it has none), as a context manager around the rest of the push. `standing`: the
    standing end a receiver makes for itself when given none. `offer`: writes into GetStatus what a sender's
    `accepts` reads. `check_serving`: raises ValueError where the standing end
    must not serve beside the server's access. `whole`: a transfer serves every target of a round with one
    version (a delta goes to none of them). `one_transfer`: the sender holds one transfer a round.
    `fallbacks`: what each failure (the receiver's refusal, or the route's own connection: OSError) gives way
    to. `by_config`: the run's config alone turns the route on (its sender reads it), whatever routes a
    pusher is given.
    `preference`: routes are offered in its order; the last is the route of last resort, which any generator
    takes and whose source claims any message."""

    route: Route
    sender: Callable[[SenderSettings], Sender | None]
    claims: Callable[[pb.WeightChunk], bool]
    source: Callable[[Any], AbstractContextManager[Source]]
    preference: int
    standing: Callable[[], Any] | None = None
    offer: Callable[[Any, pb.GetStatusReply], None] = _nothing
    check_serving: Callable[[Any, ServerAccess], None] = _nothing
    whole: bool = False
    one_transfer: bool = False
    by_config: bool = False
    fallbacks: Mapping[Reason | type[OSError], Fallback] = field(default_factory=dict)


_REGISTRY: dict[Route, RouteSpec] = {}


def register(spec: RouteSpec) -> None:
    """Make `spec` a route every pusher and receiver made from now on may use."""
    _REGISTRY[spec.route] = spec


def unregister(route: Route) -> None:
    """Pushers and receivers made from now on no longer use `route` (a route registered for a test)."""
    _REGISTRY.pop(route, None)


def registered() -> list[RouteSpec]:
    """Every registered route, in order of preference (the route of last resort last)."""
    return sorted(_REGISTRY.values(), key=lambda spec: spec.preference)


def spec_of(route: Route) -> RouteSpec:
    try:
        return _REGISTRY[route]
    except KeyError:
        names = ", ".join(spec.route.value for spec in registered())
        raise ValueError(f"no route `{route}` is registered; the routes are: {names}") from None


def last_resort() -> Route:
    """The route every generator takes and every other route falls back to."""
    return registered()[-1].route


@dataclass(frozen=True)
class Unreachable:
    """A generator that did not answer GetStatus: the push would get no answer either."""

    code: grpc.StatusCode

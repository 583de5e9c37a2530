"""The weight plane's vocabulary: the routes a push's bytes take (`Route`), the reasons a receiver refuses a
push (`Reason`), and the refusal itself (`PushRejected`).

A refusal crosses gRPC twice over: as a status code with a human-readable detail that starts with the reason
(what any gRPC client shows), and as the reason alone in the call's trailing metadata (`REASON_KEY`), which
`refusal_reason` reads back: the one place a client learns why a push was refused.
"""

from __future__ import annotations

from dataclasses import dataclass
from enum import StrEnum
from typing import ClassVar

import grpc

REASON_KEY = "asyncrlhf-refusal"  # trailing metadata of a refused push: its `Reason`


@dataclass(frozen=True)
class Route:
    """How a push's tensor bytes reach a generator, by the name a route registers under
    (`routes.RouteSpec`); gRPC carries the control and the commit on every one. The built-in ones below; a
    route registered elsewhere (a test's) is `Route("its-name")`."""

    value: str
    SHM: ClassVar[Route]  # the pusher's shared-memory segment, on the receiver's host
    DATA: ClassVar[Route]  # a TCP data connection beside the gRPC call
    STREAM: ClassVar[Route]  # inside the gRPC call's messages
    RELAY: ClassVar[Route]  # forwarded by another generator that committed the version
    COLLECTIVE: ClassVar[Route]  # broadcast in buckets to a process group of weights (gloo, NCCL)

    def __str__(self) -> str:
        return self.value


Route.SHM, Route.DATA, Route.STREAM = Route("shm"), Route("data"), Route("stream")
Route.RELAY, Route.COLLECTIVE = Route("relay"), Route("collective")


class Reason(StrEnum):
    """Why a receiver refuses a push; the generator keeps serving its old version whatever the reason."""

    UNAUTHENTICATED = "unauthenticated"  # missing or wrong token
    STALE_VERSION = "stale_version"  # not newer than the version served, in its lineage
    STALE_LINEAGE = "stale_lineage"  # of a lineage older than the one served (a replaced learner)
    UNKNOWN_TENSOR = "unknown_tensor"
    DUPLICATE_TENSOR = "duplicate_tensor"
    SHAPE_MISMATCH = "shape_mismatch"
    DTYPE_MISMATCH = "dtype_mismatch"
    BAD_OFFSET = "bad_offset"  # a tensor's bytes out of order, or beyond where they may be
    BAD_CHECKSUM = "bad_checksum"
    TRUNCATED = "truncated"  # the push ended before its bytes or its commit
    TENSOR_COUNT = "tensor_count"  # the commit counts other tensors than were sent
    MISSING_TENSORS = "missing_tensors"  # live tensors not sent, in a push not marked partial
    SHM_UNAVAILABLE = "shm_unavailable"  # the receiver cannot open the segment: the pusher streams instead
    CHANNEL_UNAVAILABLE = "channel_unavailable"  # the data connection never came: the pusher streams instead
    # the receiver cannot take part in the push's broadcast round (no such backend, a member missing, the
    # group broke mid-round): the pusher streams instead
    COLLECTIVE_UNAVAILABLE = "collective_unavailable"
    DELTA_BASE = "delta_base"  # a delta onto a version the receiver does not serve: the pusher sends it whole


class PushRejected(Exception):
    """A push the receiver refuses; nothing live was changed."""

    def __init__(self, reason: Reason, message: str):
        super().__init__(f"{reason.value}: {message}")
        self.reason = reason


def refusal_reason(err: grpc.RpcError) -> Reason | None:
    """The `Reason` a refused call carries in its trailing metadata (None: no refusal of a receiver, e.g. the
    call never reached one)."""
    trailing = getattr(err, "trailing_metadata", None)
    for key, value in (trailing() if callable(trailing) else None) or ():
        if key == REASON_KEY:
            try:
                return Reason(value)
            except ValueError:  # a newer receiver's reason: no retry rule knows it
                return None
    return None

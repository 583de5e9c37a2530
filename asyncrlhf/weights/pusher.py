"""The pushing side (learner): one version to many WeightSync servers at once.

`WeightPusher.push(state_dict, version, targets)` casts floating tensors to the push dtype once and pushes to
every target concurrently, each with its own deadline; it returns one `PushOutcome` per target: ok, rejected
(the receiver's `Reason`) or unreachable. Each target's route is asked once per address (`Routes`: the first
of the pusher's senders that accepts its GetStatus), and each version is prepared once per route, whatever
the number of targets (`Sender.begin`). A route that fails for a reason `routes.FALLBACKS` lists gives way to
the one it names, for that push and, where the table says so, from then on.

`send` is one round of pushes; a target's commit message may carry its part of a relay tree (`RelayPlan`),
which the learner's publisher chooses (`relay.TreePush`). With `delta` (`learner.push_delta`) a target that
kept the version before gets only what changed (`delta.DeltaPushes`), and a target the delta's base turns
out not to be (`delta_base`) gets the version whole in the same push; collective targets get it whole (one
broadcast serves the round's members). A round writes one segment: when a
same-host target needs the version whole, every same-host target gets it whole, and a same-host target that
refuses a delta gets it whole over the stream (unless the round wrote the whole version to a segment).
"""

from __future__ import annotations

import functools
import logging
import threading
import time
from collections import Counter
from collections.abc import Collection, Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from contextlib import ExitStack
from dataclasses import dataclass, field
from typing import Literal

import grpc
import torch

from asyncrlhf._proto import weights_pb2 as pb
from asyncrlhf.version import PolicyVersion
from asyncrlhf.weights.access import UNREACHABLE, Channels, ClientAccess
from asyncrlhf.weights.channel import DataSender
from asyncrlhf.weights.codec import MAX_MESSAGE_BYTES, Snapshot, commit_message, snapshot
from asyncrlhf.weights.collective_sender import CollectiveSender
from asyncrlhf.weights.delta import DeltaPushes, Version
from asyncrlhf.weights.routes import FALLBACKS, Fallback, Routes, Sender, Transfer, Unreachable
from asyncrlhf.weights.shm import ShmSender, shm_host
from asyncrlhf.weights.stream import StreamSender
from asyncrlhf.weights.vocabulary import Reason, Route, refusal_reason

log = logging.getLogger(__name__)
PushStatus = Literal["ok", "rejected", "unreachable"]
PROBE_TIMEOUT_S = 2.0  # GetStatus asking a new target which routes it takes
ALL_ROUTES = (Route.SHM, Route.DATA, Route.STREAM)  # in order of preference


@dataclass(frozen=True)
class PushTarget:
    id: str
    address: str  # host:port of the generator's WeightSync server


@dataclass(frozen=True)
class PushOutcome:
    """What happened to one target: `ok`, `rejected` (the receiver refused: `reason`, and `detail` says why)
    or `unreachable` (no answer within the deadline)."""

    target: PushTarget
    status: PushStatus
    code: str  # gRPC status code name ("OK", "DATA_LOSS", "UNAVAILABLE", ...)
    detail: str
    version: PolicyVersion | None  # the version the target now serves, when ok
    seconds: float
    bytes: int  # tensor bytes this pusher sent the target (0: it got the version from a relay)
    relayed_by: str = ""  # the id of the generator that forwarded the version to it ("": this pusher did)
    route: Route | None = None  # how the version reached it, when ok
    reason: Reason | None = None  # the receiver's refusal, when rejected
    encoding: str = "full"  # "delta": only what changed since the version it served was sent (when ok)


@dataclass(frozen=True)
class RelayPlan:
    """A target -> the targets it relays the version to once committed (its part of the tree), `fanout` at
    a time."""

    below: Mapping[PushTarget, Sequence[PushTarget]] = field(default_factory=dict)
    fanout: int = 0

    def commit(self, push: Snapshot, target: PushTarget) -> bytes:
        """`target`'s commit message: asking it to relay to its part of the tree, if it has one."""
        below = [(b.id, b.address) for b in self.below.get(target, ())]
        return commit_message(push, below, self.fanout).SerializeToString()


NO_RELAY = RelayPlan()


def senders(access: ClientAccess, chunk_bytes: int, timeout_s: float,
            routes: Collection[Route] = ALL_ROUTES) -> list[Sender]:
    """The learner end of each of `routes` this process can use (shared memory where it has some, a data
    channel where `access` allows one), in order of preference; the stream always: every route falls back
    to it."""
    made: list[Sender] = []
    if Route.SHM in routes and shm_host():
        made.append(ShmSender(timeout_s))
    if Route.DATA in routes and access.data_channel_allowed:
        made.append(DataSender(access, timeout_s))
    return [*made, StreamSender(chunk_bytes)]


class _Round:
    """The transfers of one round, one per route, each begun once for all its targets."""

    def __init__(self, stack: ExitStack, by_route: Mapping[Route, Sender], push: Snapshot):
        self._stack, self._senders, self._push = stack, by_route, push
        self.version, self.keep_base = push.version, push.keep_base
        self._transfers: dict[Route, Transfer] = {}
        self._lock = threading.Lock()

    def begin(self, route: Route, targets: int) -> None:
        transfer = self._transfers[route] = self._senders[route].begin(self._push, targets)
        self._stack.callback(transfer.close)

    def begun(self, route: Route) -> bool:
        with self._lock:
            return route in self._transfers

    def transfer(self, route: Route) -> Transfer:
        """The round's transfer on `route`, begun now if no target started on it (a fallback)."""
        with self._lock:
            if route not in self._transfers:
                self.begin(route, 0)
            return self._transfers[route]


class WeightPusher:
    """Pushes versions to many WeightSync servers at once, dialed with `access`. `routes`: the routes it may
    use (the stream always); a `Sender` per route, built by `senders` unless given (a test's)."""

    def __init__(self, access: ClientAccess | None = None, *, chunk_bytes: int = 4 << 20,
                 dtype: str | None = "float32", timeout_s: float = 60.0,
                 routes: Collection[Route] = ALL_ROUTES, route_senders: Sequence[Sender] | None = None,
                 delta: bool = False):
        if not 0 < chunk_bytes <= MAX_MESSAGE_BYTES:
            raise ValueError(f"push chunk_bytes must be in (0, {MAX_MESSAGE_BYTES}], got {chunk_bytes}")
        self.access = access or ClientAccess()
        self.chunk_bytes, self.dtype, self.timeout_s = chunk_bytes, dtype, timeout_s
        self.channels = Channels(self.access)
        made = route_senders if route_senders is not None else \
            senders(self.access, chunk_bytes, timeout_s, routes)
        probe = functools.partial(self.channels.get_status, timeout_s=min(PROBE_TIMEOUT_S, timeout_s))
        self.routes = Routes(made, probe)
        self.deltas = DeltaPushes() if delta else None  # the learner's base, and which target kept which

    @classmethod
    def from_config(cls, cfg, routes: Collection[Route] = ALL_ROUTES) -> WeightPusher:
        """From a `Config`: run.token, run.grpc_tls, learner.push_chunk_bytes / push_dtype / timeout_s /
        push_delta; with learner.collective, the collective route before the others."""
        lc, access = cfg.learner, ClientAccess.from_config(cfg)
        made = senders(access, lc.push_chunk_bytes, lc.push_timeout_s, routes)
        if lc.collective:
            made.insert(0, CollectiveSender.from_config(cfg, access))
        return cls(access, chunk_bytes=lc.push_chunk_bytes, dtype=lc.push_dtype, timeout_s=lc.push_timeout_s,
                   routes=routes, route_senders=made, delta=lc.push_delta)

    def prepare(self, state_dict: Mapping[str, torch.Tensor], version: PolicyVersion,
                partial: bool = False) -> Snapshot:
        """`state_dict` as a push of `version`, floating tensors cast to the push dtype."""
        return snapshot(state_dict, version, self.dtype, partial)

    def push(self, state_dict: Mapping[str, torch.Tensor], version: PolicyVersion,
             targets: Sequence[PushTarget], *, partial: bool = False) -> list[PushOutcome]:
        """Push `state_dict` as `version` to every target concurrently; one outcome per target, in order."""
        return self.send(self.prepare(state_dict, version, partial), targets)

    def probe(self, targets: Sequence[PushTarget]) -> list[Route | Unreachable]:
        """How a push reaches each target (`Routes.route`), asked concurrently."""
        if not targets:
            return []
        with ThreadPoolExecutor(max_workers=len(targets), thread_name_prefix="weight-probe") as pool:
            return list(pool.map(self.routes.route, [t.address for t in targets]))

    def send(self, push: Snapshot, targets: Sequence[PushTarget], relay: RelayPlan = NO_RELAY,
             routes: Sequence[Route | Unreachable] | None = None) -> list[PushOutcome]:
        """One round: push to every target concurrently; a target in `relay` is asked to forward the version,
        once committed, to its part of the tree. `routes`: from `probe(targets)`, when known."""
        if not targets:
            return []
        routes = routes if routes is not None else self.probe(targets)
        version = self.deltas.version(push, [t.address for t in targets]) \
            if self.deltas is not None and not push.partial else Version(push)
        # one broadcast serves every member of a collective round: the version whole
        sent = [version.full if r == Route.COLLECTIVE else self._snapshot(version, t)
                for t, r in zip(targets, routes, strict=True)]
        if any(r == Route.SHM and s is version.full for r, s in zip(routes, sent, strict=True)):
            sent = [version.full if r == Route.SHM else s for r, s in zip(routes, sent, strict=True)]
        with ExitStack() as stack, ThreadPoolExecutor(max_workers=len(targets),
                                                      thread_name_prefix="weight-push") as pool:
            rounds = {id(s): _Round(stack, self.routes.senders, s)
                      for s in (version.full, version.delta) if s is not None}
            for snap in (version.delta, version.full):  # each round's segment writer first
                if snap is None:
                    continue
                counts = Counter(r for r, s in zip(routes, sent, strict=True)
                                 if isinstance(r, Route) and s is snap)
                for route in [r for r in self.routes.senders if r in counts]:
                    rounds[id(snap)].begin(route, counts[route])
            whole = rounds[id(version.full)]
            futures = [pool.submit(self._push_one, rounds[id(s)], t, r, relay.commit(version.full, t),
                                   whole if s is version.delta else None)
                       for t, r, s in zip(targets, routes, sent, strict=True)]
            return [f.result() for f in futures]

    def _snapshot(self, version: Version, target: PushTarget) -> Snapshot:
        return self.deltas.snapshot(version, target.address) if self.deltas is not None else version.full

    def get_status(self, address: str, timeout_s: float = 5.0) -> pb.GetStatusReply:
        return self.channels.get_status(address, timeout_s)

    def close(self) -> None:
        self.channels.close()
        for sender in self.routes.senders.values():
            sender.close()

    def __enter__(self) -> WeightPusher:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def _push_one(self, transfers: _Round, target: PushTarget, route: Route | Unreachable,
                  commit: bytes, whole: _Round | None = None) -> PushOutcome:
        """One target's push; `whole`: the version sent whole, when `transfers` sends it as a delta (taken
        if the target refuses the delta's base)."""
        outcome = self._push_route(transfers, target, route, commit, whole)
        if self.deltas is not None:
            if outcome.status == "ok" and outcome.version is not None and transfers.keep_base:
                self.deltas.acknowledged(target.address, outcome.version)
            else:
                self.deltas.forget(target.address)
        return outcome

    def _push_route(self, transfers: _Round, target: PushTarget, route: Route | Unreachable,
                    commit: bytes, whole: _Round | None) -> PushOutcome:
        start = time.perf_counter()
        if isinstance(route, Unreachable):
            return PushOutcome(target, "unreachable", route.code, "no answer to GetStatus", None, 0.0, 0)
        call = self.channels.push_call(target.address, self.timeout_s)
        while True:
            try:
                reply = transfers.transfer(route).send_weights(call, target.address, commit)
                return PushOutcome(target, "ok", "OK", "", PolicyVersion(reply.lineage, reply.version),
                                   time.perf_counter() - start, reply.bytes, route=route,
                                   encoding="full" if whole is None else "delta")
            except (grpc.RpcError, OSError) as err:
                if whole is not None and isinstance(err, grpc.RpcError) and \
                        refusal_reason(err) == Reason.DELTA_BASE:
                    log.info("%s holds no base for the delta of %s: pushing it whole", target.address,
                             transfers.version)
                    transfers, whole = whole, None
                    if route == Route.SHM and not transfers.begun(route):
                        route = Route.STREAM  # the sender's segments hold one transfer at a time
                    continue
                fallback = _fallback(route, err)
                if fallback is None:
                    if isinstance(err, OSError):
                        raise
                    return _refused(target, err, time.perf_counter() - start)
                log.warning("push to %s over %s failed (%s): pushing over %s", target.address, route.value,
                            err.details() if isinstance(err, grpc.RpcError) else err, fallback.to.value)
                self.routes.fall_back(target.address, route, fallback)
                route = fallback.to


def _fallback(route: Route, err: grpc.RpcError | OSError) -> Fallback | None:
    failed = OSError if isinstance(err, OSError) else refusal_reason(err)
    return FALLBACKS.get((route, failed)) if failed is not None else None


def _refused(target: PushTarget, err: grpc.RpcError, seconds: float) -> PushOutcome:
    code = err.code()
    status: PushStatus = "unreachable" if code in UNREACHABLE else "rejected"
    return PushOutcome(target, status, code.name, err.details() or "", None, seconds, 0,
                       reason=refusal_reason(err))

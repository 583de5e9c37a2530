"""The pushing side (learner): one version to many WeightSync servers at once.

`WeightPusher.push(state_dict, version, targets)` casts floating tensors to the push dtype once and pushes to
every target concurrently, each with its own deadline; it returns one `PushOutcome` per target: ok, rejected
(the receiver's `Reason`) or unreachable. Each target's route is asked once per address (`Routes`: the first
of the pusher's senders, one per registered route, that accepts its GetStatus), and each version is prepared
once per route, whatever the number of targets (`Sender.begin`). A route that fails for a reason its
`RouteSpec.fallbacks` lists gives way to the route it names, for that push and, where it says so, from then
on.

`send` is one round of pushes; a target's commit message may carry its part of a relay tree (`RelayPlan`),
which the learner's publisher chooses (`relay.TreePush`). With `delta` (`learner.push_delta`) the round goes
through `_send_delta`: a target that kept the version before gets only what changed (`delta.DeltaPushes`), and
a target the delta's base turns out not to be (`delta_base`) gets the version whole in the same push; the
route's spec says which targets get it whole regardless (`whole`, `one_transfer`).
"""

from __future__ import annotations

import dataclasses
import functools
import logging
import threading
import time
from collections import Counter
from collections.abc import Callable, Collection, Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from contextlib import ExitStack
from dataclasses import dataclass, field
from enum import StrEnum

import grpc
import torch

from asyncrlhf._proto import weights_pb2 as pb
from asyncrlhf.version import PolicyVersion
from asyncrlhf.weights.access import UNREACHABLE, Channels, ClientAccess
from asyncrlhf.weights.codec import MAX_MESSAGE_BYTES, Snapshot, commit_message, snapshot
from asyncrlhf.weights.delta import DeltaPushes
from asyncrlhf.weights.routes import (
    Fallback,
    Sender,
    SenderSettings,
    Transfer,
    Unreachable,
    last_resort,
    registered,
    spec_of,
)
from asyncrlhf.weights.vocabulary import Reason, Route, refusal_reason

log = logging.getLogger(__name__)
PROBE_TIMEOUT_S = 2.0  # GetStatus asking a new target which routes it takes


class PushStatus(StrEnum):
    OK = "ok"
    REJECTED = "rejected"  # the receiver refused the push
    UNREACHABLE = "unreachable"  # no answer within the deadline


class Encoding(StrEnum):
    FULL = "full"  # every tensor whole
    DELTA = "delta"  # only what changed since the version the target served


@dataclass(frozen=True)
class PushTarget:
    id: str
    address: str  # host:port of the generator's WeightSync server


@dataclass(frozen=True)
class PushOutcome:
    """What happened to one target: `status`; when rejected, the receiver's `reason` (`detail` says why)."""

    target: PushTarget
    status: PushStatus
    code: grpc.StatusCode
    detail: str
    version: PolicyVersion | None  # the version the target now serves, when ok
    seconds: float
    bytes: int  # tensor bytes this pusher sent the target (0: it got the version from a relay)
    relayed_by: str = ""  # the id of the generator that forwarded the version to it ("": this pusher did)
    route: Route | None = None  # how the version reached it, when ok
    reason: Reason | None = None  # the receiver's refusal, when rejected
    encoding: Encoding = Encoding.FULL  # how the version was sent, when ok


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


def senders(settings: SenderSettings, routes: Collection[Route] | None = None) -> list[Sender]:
    """The learner end of each registered route (of `routes`, if given) this process can take, in order of
    preference; the route of last resort always, and the routes the config turns on."""
    chosen = [spec for spec in registered() if routes is None or spec.route in routes or spec.by_config or
              spec.route == last_resort()]
    return [sender for spec in chosen if (sender := spec.sender(settings)) is not None]


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
                return Unreachable(err.code()) if err.code() in UNREACHABLE else last_resort()
        avoid = self._avoid.get(address, set())
        return next((route for route, sender in self.senders.items()
                     if route not in avoid and sender.accepts(address, status)), last_resort())

    def fall_back(self, address: str, failed: Route, err: grpc.RpcError | OSError) -> Route | None:
        """The route a push to `address` that failed on `failed` with `err` takes now, if any."""
        cause = OSError if isinstance(err, OSError) else refusal_reason(err)
        fallback: Fallback | None = spec_of(failed).fallbacks.get(cause) if cause is not None else None
        if fallback is None:
            return None
        self.senders[failed].forget(address)
        if fallback.avoid:
            self._avoid.setdefault(address, set()).add(failed)
        else:
            self._status.pop(address, None)
        return fallback.to or last_resort()


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

    def begin_all(self, routes: Sequence[Route | Unreachable]) -> None:
        """Begin the transfer of each route of `routes` (one per target), in the senders' order."""
        counts = Counter(r for r in routes if isinstance(r, Route))
        for route in [r for r in self._senders if r in counts]:
            self.begin(route, counts[route])

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
    """Pushes versions to many WeightSync servers at once, dialed with `access`. `routes`: the registered
    routes it may use (None: all it can take; the route of last resort always); a `Sender` per route, built
    by `senders` unless given (a test's)."""

    def __init__(self, access: ClientAccess | None = None, *, chunk_bytes: int = 4 << 20,
                 dtype: str | None = "float32", timeout_s: float = 60.0,
                 routes: Collection[Route] | None = None, route_senders: Sequence[Sender] | None = None,
                 delta: bool = False):
        if not 0 < chunk_bytes <= MAX_MESSAGE_BYTES:
            raise ValueError(f"push chunk_bytes must be in (0, {MAX_MESSAGE_BYTES}], got {chunk_bytes}")
        self.access = access or ClientAccess()
        self.chunk_bytes, self.dtype, self.timeout_s = chunk_bytes, dtype, timeout_s
        self.channels = Channels(self.access)
        made = route_senders if route_senders is not None else \
            senders(SenderSettings(self.access, chunk_bytes, timeout_s), routes)
        probe = functools.partial(self.channels.get_status, timeout_s=min(PROBE_TIMEOUT_S, timeout_s))
        self.routes = Routes(made, probe)
        self.deltas = DeltaPushes() if delta else None  # the learner's base, and which target kept which

    @classmethod
    def from_config(cls, cfg, routes: Collection[Route] | None = None) -> WeightPusher:
        """From a `Config`: run.token, run.grpc_tls, learner.push_chunk_bytes / push_dtype / timeout_s /
        push_delta; the routes that need the config read theirs (learner.collective)."""
        lc, access = cfg.learner, ClientAccess.from_config(cfg)
        made = senders(SenderSettings(access, lc.push_chunk_bytes, lc.push_timeout_s, cfg), routes)
        return cls(access, chunk_bytes=lc.push_chunk_bytes, dtype=lc.push_dtype, timeout_s=lc.push_timeout_s,
                   route_senders=made, delta=lc.push_delta)

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
        if self.deltas is not None and not push.partial:
            return self._send_delta(self.deltas, push, targets, relay, routes)
        with ExitStack() as stack, ThreadPoolExecutor(max_workers=len(targets),
                                                      thread_name_prefix="weight-push") as pool:
            round_ = _Round(stack, self.routes.senders, push)
            round_.begin_all(routes)
            futures = [pool.submit(self._push_route, round_, t, r, relay.commit(push, t))
                       for t, r in zip(targets, routes, strict=True)]
            return [f.result() for f in futures]

    def _send_delta(self, deltas: DeltaPushes, push: Snapshot, targets: Sequence[PushTarget],
                    relay: RelayPlan, routes: Sequence[Route | Unreachable]) -> list[PushOutcome]:
        """`send` with delta pushes on: each target gets the version's delta if it kept the delta's base, but
        on a route that sends each round whole, and on a route of one transfer a round where any of its
        targets needs the version whole."""
        version = deltas.version(push, [t.address for t in targets])
        sent = [version.full if isinstance(r, Route) and spec_of(r).whole else
                deltas.snapshot(version, t.address) for t, r in zip(targets, routes, strict=True)]
        single = {r for r, s in zip(routes, sent, strict=True)
                  if isinstance(r, Route) and spec_of(r).one_transfer and s is version.full}
        sent = [version.full if r in single else s for r, s in zip(routes, sent, strict=True)]
        with ExitStack() as stack, ThreadPoolExecutor(max_workers=len(targets),
                                                      thread_name_prefix="weight-push") as pool:
            rounds = {id(s): _Round(stack, self.routes.senders, s)
                      for s in (version.full, version.delta) if s is not None}
            for snap in (version.delta, version.full):  # each round's segment writer first
                if snap is not None:
                    rounds[id(snap)].begin_all([r for r, s in zip(routes, sent, strict=True) if s is snap])
            whole = rounds[id(version.full)]
            futures = [pool.submit(self._push_delta, deltas, rounds[id(s)], t, r,
                                   relay.commit(version.full, t), whole if s is version.delta else None)
                       for t, r, s in zip(targets, routes, sent, strict=True)]
            return [f.result() for f in futures]

    def _push_delta(self, deltas: DeltaPushes, transfers: _Round, target: PushTarget,
                    route: Route | Unreachable, commit: bytes, whole: _Round | None) -> PushOutcome:
        """One target's push of a delta round; `whole`: the version sent whole, when `transfers` sends it as
        a delta (taken if the target refuses the delta's base)."""
        outcome = self._push_route(transfers, target, route, commit)
        if whole is not None and outcome.reason == Reason.DELTA_BASE and isinstance(route, Route):
            log.info("%s holds no base for the delta of %s: pushing it whole", target.address,
                     transfers.version)
            if spec_of(route).one_transfer and not whole.begun(route):
                route = last_resort()  # the sender holds one transfer a round: the delta's
            first, transfers = outcome, whole
            outcome = self._push_route(transfers, target, route, commit)
            outcome = dataclasses.replace(outcome, seconds=first.seconds + outcome.seconds)
        elif whole is not None and outcome.status == PushStatus.OK:
            outcome = dataclasses.replace(outcome, encoding=Encoding.DELTA)
        if outcome.status == PushStatus.OK and outcome.version is not None and transfers.keep_base:
            deltas.acknowledged(target.address, outcome.version)
        else:
            deltas.forget(target.address)
        return outcome

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

    def _push_route(self, transfers: _Round, target: PushTarget, route: Route | Unreachable,
                    commit: bytes) -> PushOutcome:
        start = time.perf_counter()
        if isinstance(route, Unreachable):
            return PushOutcome(target, PushStatus.UNREACHABLE, route.code, "no answer to GetStatus", None,
                               0.0, 0)
        call = self.channels.push_call(target.address, self.timeout_s)
        while True:
            try:
                reply = transfers.transfer(route).send_weights(call, target.address, commit)
                return PushOutcome(target, PushStatus.OK, grpc.StatusCode.OK, "",
                                   PolicyVersion(reply.lineage, reply.version), time.perf_counter() - start,
                                   reply.bytes, route=route)
            except (grpc.RpcError, OSError) as err:
                instead = self.routes.fall_back(target.address, route, err)
                if instead is None:
                    if isinstance(err, OSError):
                        raise
                    return _refused(target, err, time.perf_counter() - start)
                log.warning("push to %s over %s failed (%s): pushing over %s", target.address, route,
                            err.details() if isinstance(err, grpc.RpcError) else err, instead)
                route = instead


def _refused(target: PushTarget, err: grpc.RpcError, seconds: float) -> PushOutcome:
    code = err.code()
    status = PushStatus.UNREACHABLE if code in UNREACHABLE else PushStatus.REJECTED
    return PushOutcome(target, status, code, err.details() or "", None, seconds, 0,
                       reason=refusal_reason(err))

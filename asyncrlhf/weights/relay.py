"""Relays: a generator that has committed a version forwards it to others, so the learner's upload does not
grow with the number of generators.

The tree. `plan(targets, k)` splits a list into at most k contiguous parts of nearly equal size; the first
target of each part is pushed to and relays to the rest of its part, which it splits the same way. So with
`learner.relay_fanout` k the learner streams each version to k generators, every generator forwards it to at
most k others, and 64 generators with k = 2 are 6 hops deep. The plan travels in the push: a target's commit
message carries the rest of its part (`WeightChunk.relay_targets`) and k (`relay_fanout`).

The relaying generator (`Relay`, beside its WeightSync server). Only after its own commit — a refused push
relays nothing — it forwards the snapshot it verified, with the same version and checksums (the learner's
XXH3-64s, not recomputed: its children check the learner's bytes), from a background thread, with its own
`WeightPusher` (the run's token and TLS settings; data channel or stream). Until it is done its receiver is
held, so a next push stages into fresh buffers rather than over the bytes being forwarded; its GetStatus
says `relaying` meanwhile. A child it cannot reach, or that refuses, is logged.

The learner (`TreePush`, what the learner's publisher runs when `learner.relay_fanout` > 0). Same-host targets
keep the shared-memory route and are never part of the tree; the others are. After streaming to the roots it
asks the relayed targets' GetStatus until each serves the version, and pushes directly (with that target's
own part of the tree, so the relay goes on below it) to a target whose parent failed its push, no longer
answers, or finished relaying without it; at the deadline (`timeout_s` per level) it pushes to every target
still behind, without relays. So a generator that dies mid-relay costs the learner one push per child of it,
and nobody stays on the old version; a target the learner cannot push either is reported as usual and the
learner's late-generator sync retries it.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Sequence
from concurrent.futures import Future, ThreadPoolExecutor, wait
from typing import TypeVar

import grpc

from asyncrlhf._proto import weights_pb2 as pb
from asyncrlhf.version import PolicyVersion
from asyncrlhf.weights.access import ClientAccess
from asyncrlhf.weights.codec import Snapshot
from asyncrlhf.weights.pusher import PushOutcome, PushStatus, PushTarget, RelayPlan, WeightPusher
from asyncrlhf.weights.receiver import PushResult
from asyncrlhf.weights.routes import Unreachable
from asyncrlhf.weights.vocabulary import Reason, Route

log = logging.getLogger(__name__)
T = TypeVar("T")
POLL_S = (0.02, 0.2)  # GetStatus of the relayed targets: first interval, doubling up to the second


def plan(targets: Sequence[T], fanout: int) -> list[tuple[T, list[T]]]:
    """`targets` in at most `fanout` contiguous parts of nearly equal size (the first ones one larger), each
    as (its first target, the rest of it): who is pushed to, and what it relays to."""
    if fanout < 1:
        raise ValueError(f"relay fanout must be >= 1, got {fanout}")
    parts, start, out = min(fanout, len(targets)), 0, []
    for i in range(parts):
        size = len(targets) // parts + (1 if i < len(targets) % parts else 0)
        out.append((targets[start], list(targets[start + 1:start + size])))
        start += size
    return out


def layout(targets: Sequence[T], fanout: int) -> dict[T, tuple[T | None, list[T]]]:
    """The whole tree: each target -> (its parent, None for a root; the targets it relays to)."""
    tree: dict[T, tuple[T | None, list[T]]] = {}

    def place(part: Sequence[T], parent: T | None) -> None:
        for root, below in plan(part, fanout):
            tree[root] = (parent, below)
            place(below, root)

    place(targets, None)
    return tree


class Relay:
    """Forwards committed versions whose commit message names relay targets (the receiver side), with
    `pusher` (which takes no shared memory: a relay's children are on other hosts)."""

    def __init__(self, pusher: WeightPusher):
        self.pusher = pusher
        self._active = 0  # relays announced (commit seen) and not yet finished
        self._lock = threading.Lock()

    @classmethod
    def from_config(cls, cfg) -> Relay:
        """The run's token and TLS client settings, learner.push_chunk_bytes and push_timeout_s."""
        return cls(relay_pusher(ClientAccess.from_config(cfg), cfg.learner.push_chunk_bytes,
                                cfg.learner.push_timeout_s))

    @property
    def relaying(self) -> bool:
        return self._active > 0

    def expect(self) -> None:
        """A commit asking for a relay is being received: `relaying` from now on, before the version shows."""
        with self._lock:
            self._active += 1

    def abandon(self) -> None:
        """The push that asked for a relay was not committed: nothing to relay."""
        with self._lock:
            self._active -= 1

    def start(self, result: PushResult, commit: pb.WeightChunk, done: Callable[[], None]) -> None:
        """Forward the committed `result` as `commit` asks, in the background; then call `done`."""
        targets = [PushTarget(t.id, t.address) for t in commit.relay_targets]
        threading.Thread(target=self._forward, args=(result, targets, max(1, commit.relay_fanout), done),
                         name="weight-relay", daemon=True).start()

    def close(self) -> None:
        """Stop: relays in flight are cancelled (their targets' pushes fail; the learner pushes to them)."""
        self.pusher.close()

    def _forward(self, result: PushResult, targets: list[PushTarget], fanout: int,
                 done: Callable[[], None]) -> None:
        push = result.snapshot
        try:
            branches = plan(targets, fanout)
            roots = [root for root, _ in branches]
            outcomes = self.pusher.send(push, roots, RelayPlan(dict(branches), fanout))
            for o in outcomes:
                if o.status != PushStatus.OK:
                    log.warning("relay of version %s to %s (%s) %s: %s %s; the learner pushes to it directly",
                                push.version, o.target.id, o.target.address, o.status, o.code, o.detail)
        except Exception:
            log.exception("relay of version %s failed; the learner pushes to its targets directly",
                          push.version)
        finally:
            done()
            self.abandon()


def relay_pusher(access: ClientAccess, chunk_bytes: int, timeout_s: float) -> WeightPusher:
    """A relay's pusher: the bytes as verified (no cast), over data channels or the stream."""
    return WeightPusher(access, chunk_bytes=chunk_bytes, dtype=None, timeout_s=timeout_s,
                        routes=(Route.DATA, Route.STREAM))


def _serves(status: pb.GetStatusReply, version: PolicyVersion) -> bool:
    return not version.newer_than(PolicyVersion(status.lineage, status.version))


class TreePush:
    """One version through the relay tree, from the learner's side: push to the roots, follow the relays,
    push directly where one failed. `run` returns one outcome per target, in order."""

    def __init__(self, pusher: WeightPusher, push: Snapshot, fanout: int):
        if fanout < 1:
            raise ValueError(f"relay fanout must be >= 1, got {fanout}")
        self.pusher, self.push, self.fanout = pusher, push, fanout
        self.tree: dict[PushTarget, tuple[PushTarget | None, list[PushTarget]]] = {}
        self.outcomes: dict[PushTarget, PushOutcome] = {}
        self.pending: set[PushTarget] = set()  # relayed, neither served nor pushed to directly yet
        self.quiet: set[PushTarget] = set()  # committed, seen not relaying (in an earlier round)
        self._sends: list[Future] = []
        self._start = time.perf_counter()

    def run(self, targets: Sequence[PushTarget]) -> list[PushOutcome]:
        routes = self.pusher.probe(targets)
        streamed = [t for t, r in zip(targets, routes, strict=True)  # other hosts
                    if r in (Route.STREAM, Route.DATA)]
        self.tree = layout(streamed, self.fanout)
        direct = [(t, r) for t, r in zip(targets, routes, strict=True) if self._parent(t) is None]
        self.pending = {t for t in streamed if self._parent(t) is not None}
        depth = max((self._depth(t) for t in streamed), default=0)
        deadline = time.monotonic() + self.pusher.timeout_s * (depth + 1)
        with ThreadPoolExecutor(max_workers=max(4, self.fanout), thread_name_prefix="weight-tree") as pool:
            self._sends.append(pool.submit(self._send, [t for t, _ in direct], [p for _, p in direct], True))
            interval = POLL_S[0]
            while self.pending or self._sends:
                self._harvest()
                if time.monotonic() > deadline:
                    self._push_directly(pool, sorted(self.pending, key=targets.index), relay=False)
                progressed = self._follow(pool, targets)
                interval = POLL_S[0] if progressed else min(POLL_S[1], interval * 2)
                if self._sends:
                    wait(self._sends, timeout=interval, return_when="FIRST_COMPLETED")
                elif self.pending:
                    time.sleep(interval)
        return [self.outcomes[t] for t in targets]

    def _parent(self, target: PushTarget) -> PushTarget | None:
        return self.tree[target][0] if target in self.tree else None

    def _depth(self, target: PushTarget) -> int:
        parent = self._parent(target)
        return 1 if parent is None else 1 + self._depth(parent)

    def _send(self, targets: list[PushTarget], routes: list[Route | Unreachable] | None,
              relay: bool) -> list[PushOutcome]:
        below = {t: self.tree[t][1] for t in targets if t in self.tree} if relay else {}
        return self.pusher.send(self.push, targets, RelayPlan(below, self.fanout if relay else 0), routes)

    def _push_directly(self, pool: ThreadPoolExecutor, targets: list[PushTarget], relay: bool = True) -> None:
        if targets:
            self.pending.difference_update(targets)
            self._sends.append(pool.submit(self._send, targets, None, relay))

    def _harvest(self) -> None:
        """Record the direct pushes that ended. A target that refused as stale already got the version (or a
        newer one) through its relay after all."""
        for future in [f for f in self._sends if f.done()]:
            self._sends.remove(future)
            for o in future.result():
                relayed = self._parent(o.target) is not None
                if o.reason == Reason.STALE_VERSION and relayed and self._serving(o.target):
                    o = self._relayed(o.target)
                self.outcomes[o.target] = o

    def _relayed(self, target: PushTarget) -> PushOutcome:
        parent = self._parent(target)
        return PushOutcome(target, PushStatus.OK, grpc.StatusCode.OK, "", self.push.version,
                           time.perf_counter() - self._start, 0, parent.id if parent is not None else "",
                           route=Route.RELAY)

    def _follow(self, pool: ThreadPoolExecutor, order: Sequence[PushTarget]) -> bool:
        """One round of GetStatus over the frontier: the pending targets whose parent committed, and those
        parents. Pushes directly to those that their parent will not serve; whether any target resolved."""
        before = len(self.pending)
        committed = {t for t, o in self.outcomes.items() if o.status == PushStatus.OK}
        failed = set(self.outcomes) - committed
        orphans = {t for t in self.pending if self._parent(t) in failed}  # their relay never started
        frontier = [t for t in self.pending if self._parent(t) in committed]
        parents = list({p for t in frontier if (p := self._parent(t)) is not None})
        quiet_before = set(self.quiet)  # seen before this round's questions to their children were asked
        with ThreadPoolExecutor(max_workers=max(1, min(16, len(frontier) + len(parents))),
                                thread_name_prefix="weight-follow") as asker:
            asked = dict(zip([*frontier, *parents],
                             asker.map(self._status_or_none, [*frontier, *parents]), strict=True))
        for parent in parents:
            status = asked[parent]
            if status is None or not _serves(status, self.push.version):
                orphans.update(t for t in frontier if self._parent(t) == parent)  # gone, or restarted
            elif not status.relaying:
                self.quiet.add(parent)
        for target in frontier:
            status = asked[target]
            if status is not None and _serves(status, self.push.version):
                self.pending.discard(target)
                orphans.discard(target)
                self.outcomes[target] = self._relayed(target)
            elif self._parent(target) in quiet_before:  # it finished relaying without this target
                orphans.add(target)
        self._push_directly(pool, sorted(orphans & self.pending, key=order.index))
        return len(self.pending) != before

    def _serving(self, target: PushTarget) -> bool:
        status = self._status_or_none(target)
        return status is not None and _serves(status, self.push.version)

    def _status_or_none(self, target: PushTarget) -> pb.GetStatusReply | None:
        try:
            return self.pusher.get_status(target.address, timeout_s=min(2.0, self.pusher.timeout_s))
        except grpc.RpcError:
            return None

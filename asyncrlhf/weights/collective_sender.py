"""The learner end of the collective route (`Route.COLLECTIVE`): a version broadcast in buckets to a weight
group of generators (`collective.py` says how a round goes), control and commit over each one's gRPC call.

`CollectiveSender` keeps the rendezvous store and the groups (one per set of members, the last
`KEPT_GROUPS`); `CollectiveTransfer` is one round: it waits for every target's call to arrive (they fix the
membership), sends each target its control messages (every tensor's name, shape, dtype, XXH3-64, and where
its bytes lie in which bucket, with that bucket's XXH3-64), and broadcasts the buckets on a thread of its
own once every member is there. Both checksums come from one pass over the snapshot's bytes (`Checksums`,
each block hashed into its tensor's digest and its bucket's while in cache), made before the bucket is
packed: a packing or transport fault fails the bucket's check at the receiver, a tensor's bytes its own.
"""

from __future__ import annotations

import datetime
import itertools
import logging
import secrets
import threading
import time
from collections import deque
from collections.abc import Iterator

import grpc
import numpy as np
import torch
import xxhash
from torch.distributed import TCPStore

from asyncrlhf._proto import weights_pb2 as pb
from asyncrlhf.weights.access import UNREACHABLE, ClientAccess, PushCall
from asyncrlhf.weights.codec import Snapshot, tensor_header
from asyncrlhf.weights.collective import (
    ABANDONED,
    GO,
    IN_FLIGHT,
    JOIN_TIMEOUT_S,
    Group,
    Kept,
    Plan,
    broadcast,
    device_of,
    go_key,
    here_key,
    resolved,
)
from asyncrlhf.weights.vocabulary import Route

log = logging.getLogger(__name__)
EXCLUDED_S = 30.0  # a generator that missed a round or did not answer gets another route this long
HASH_BLOCK = 1 << 20
POLL_S = 0.002


class Checksums:
    """Every tensor's XXH3-64 (the one it carries, if any: a relay's) and every bucket's, computed on a thread
    of their own in one pass; `bucket(k)` waits for bucket k's."""

    def __init__(self, push: Snapshot, plan: Plan):
        self.push, self.plan = push, plan
        self.tensors: list[int] = [0] * len(push.tensors)
        self._buckets: list[int] = []
        self._cond = threading.Condition()
        threading.Thread(target=self._hash, name="weight-collective-hash", daemon=True).start()

    def _hash(self) -> None:
        for k in range(len(self.plan.sizes)):
            whole = xxhash.xxh3_64()
            for i in self.plan.members(k):
                t = self.push.tensors[i]
                own = xxhash.xxh3_64()
                for start in range(0, t.data.nbytes, HASH_BLOCK):
                    block = t.data[start:start + HASH_BLOCK]
                    whole.update(block)
                    own.update(block)
                self.tensors[i] = own.intdigest() if t.checksum is None else t.checksum
            with self._cond:
                self._buckets.append(whole.intdigest())
                self._cond.notify_all()

    def bucket(self, k: int) -> int:
        with self._cond:
            self._cond.wait_for(lambda: len(self._buckets) > k)
            return self._buckets[k]


class CollectiveTransfer:
    """One version broadcast to the targets of one round; the sender's round lock is held until `close`."""

    def __init__(self, sender: CollectiveSender, push: Snapshot, targets: int):
        self.sender, self.push, self.targets = sender, push, targets
        self.plan = Plan.of(push.tensors, sender.bucket_bytes)
        self.sums = Checksums(push, self.plan)
        self._arrived: list[str] = []
        self._ended: set[str] = set()
        self._cond = threading.Condition()
        self._group: Group | None = None
        self._members: tuple[str, ...] = ()  # the group's: rank i + 1 is `_members[i]`
        self._round = 0
        self._failed = "" if targets > 0 else "the round counts no targets"
        self._thread: threading.Thread | None = None

    def send_weights(self, call: PushCall, address: str, commit: bytes) -> pb.PushReply:
        """This target's control messages and commit over `call` while the round's broadcast carries the
        bytes; OSError when the round cannot be formed (the pusher streams to the target instead)."""
        slot = self._arrive(address)
        try:
            return call(itertools.chain(self._messages(slot), (commit,)))
        except grpc.RpcError as err:
            if err.code() in UNREACHABLE:  # gone (killed?): the next rounds build a group without it
                self.sender.exclude([address])
            raise
        finally:
            with self._cond:
                self._ended.add(address)

    def _arrive(self, address: str) -> pb.CollectiveSlot:
        with self._cond:
            self._arrived.append(address)
            if len(self._arrived) == self.targets:
                self._start()
            self._cond.notify_all()
            formed = self._cond.wait_for(self._formed, JOIN_TIMEOUT_S)
            if self._failed or not formed or self._group is None or address not in self._members:
                why = self._failed or "the round's other targets never came"
                raise OSError(f"no collective round for {address}: {why}")
            return pb.CollectiveSlot(
                store=self.sender.store_address, group=self._group.id,
                rank=self._members.index(address) + 1, world_size=self._group.world_size,
                backend=self._group.backend, timeout_ms=int(self.sender.timeout_s * 1000), round=self._round,
                bucket_bytes=self.plan.sizes)

    def _formed(self) -> bool:
        return self._group is not None or self._failed != ""

    def _start(self) -> None:
        """Every target arrived (under the lock): the round's group (built anew if its members are new)."""
        try:
            self._members = tuple(sorted(self._arrived))
            group = self._group = self.sender.group(self._members)
        except (RuntimeError, OSError) as err:  # the store could not be served
            self._failed = str(err)
            return
        group.rounds += 1
        self._round = group.rounds
        self._thread = threading.Thread(target=self._broadcast, args=(group, self._round),
                                        name="weight-collective-broadcast", daemon=True)
        self._thread.start()

    def _messages(self, slot: pb.CollectiveSlot) -> Iterator[bytes]:
        for i, t in enumerate(self.push.tensors):
            bucket, offset = self.plan.places[i]
            where = pb.CollectiveSlot(bucket=bucket, bucket_offset=offset,
                                      bucket_checksum=self.sums.bucket(bucket))
            where.MergeFrom(slot)
            header = tensor_header(self.push.version, t, checksum=self.sums.tensors[i], collective=where)
            yield header.SerializeToString()

    def _missing(self, group: Group, round_id: int) -> list[str]:
        """Wait until every member said it is here for `round_id`; the members that did not (their call
        ended first, or `JOIN_TIMEOUT_S` passed)."""
        deadline = time.monotonic() + min(JOIN_TIMEOUT_S, self.sender.timeout_s)
        waiting = dict(enumerate(self._members, start=1))
        while waiting:
            for rank in [r for r in waiting if group.keys.check([here_key(round_id, r)])]:
                del waiting[rank]
            with self._cond:
                gone = [a for a in waiting.values() if a in self._ended]
            if gone or time.monotonic() > deadline:
                return gone or list(waiting.values())
            time.sleep(POLL_S)
        return []

    def _broadcast(self, group: Group, round_id: int) -> None:
        missing = self._missing(group, round_id)
        if missing:
            group.keys.set(go_key(round_id), ABANDONED)
            self.sender.exclude(missing)
            log.warning("collective round %d abandoned: %s did not join it; their peers are streamed to, and "
                        "the next round builds a group without them", round_id, ", ".join(missing))
            return
        group.keys.set(go_key(round_id), GO)
        try:
            self._send_buckets(group.built(), group.backend)
        except RuntimeError as err:  # a member died or timed out: gloo closed the group's pairs
            log.warning("collective round %d failed (%s): the group is dropped and rebuilt", round_id, err)
            self.sender.groups.drop(self._members, group)

    def _send_buckets(self, process_group, backend: str) -> None:
        device = device_of(backend, self.sender.device)
        ring = self.sender.groups.ring(max(self.plan.sizes, default=0), torch.device("cpu"))
        works: deque = deque()
        for k, size in enumerate(self.plan.sizes):
            if len(works) == IN_FLIGHT:
                works.popleft().wait()
            if not size:
                continue
            packed = ring[k % IN_FLIGHT][:size]
            self.pack(k, packed.numpy())
            works.append(broadcast(process_group, packed if device.type == "cpu" else packed.to(device)))
        for work in works:
            work.wait()

    def pack(self, bucket: int, out: np.ndarray) -> None:
        """Copy the tensors of `bucket` into `out`, each at its offset."""
        for i in self.plan.members(bucket):
            data = self.push.tensors[i].data
            offset = self.plan.places[i][1]
            out[offset:offset + data.nbytes] = np.frombuffer(data, dtype=np.uint8)

    def close(self) -> None:
        """Wait for the broadcast to end (every op is bounded by the group's timeout), then let the next
        round begin."""
        try:
            if self._thread is not None:
                self._thread.join()
        finally:
            self.sender.round_lock.release()


class CollectiveSender:
    """The learner end of `Route.COLLECTIVE`: generators whose GetStatus offers a collective backend, unless
    WeightSync is TLS (gloo and NCCL carry no TLS) or the generator missed a round in the last `EXCLUDED_S`.
    `host`: the learner's address the generators reach its rendezvous store at; `device`: where
    the learner's tensors live (CUDA: NCCL with generators that offer it)."""

    route = Route.COLLECTIVE

    def __init__(self, host: str = "127.0.0.1", bucket_bytes: int = 64 << 20, timeout_s: float = 60.0,
                 device: str = "cpu", access: ClientAccess | None = None):
        if bucket_bytes <= 0:
            raise ValueError(f"learner.collective_bucket_bytes must be > 0, got {bucket_bytes}")
        self.host, self.bucket_bytes, self.timeout_s, self.device = host, bucket_bytes, timeout_s, device
        self.tls = access is not None and access.credentials is not None
        self.round_lock = threading.Lock()  # one round at a time: the groups are shared
        self._offered: dict[str, tuple[str, ...]] = {}
        self._excluded: dict[str, float] = {}  # address -> time.monotonic() until which it is left out
        self.groups = Kept()  # by members
        self._store: TCPStore | None = None

    @classmethod
    def from_config(cls, cfg, access: ClientAccess) -> CollectiveSender:
        """learner.collective_host / collective_bucket_bytes / push_timeout_s / device."""
        lc = cfg.learner
        return cls(lc.collective_host, lc.collective_bucket_bytes, lc.push_timeout_s,
                   resolved(lc.device), access)

    @property
    def store_address(self) -> str:
        return f"{self.host}:{self.store().port}"

    def store(self) -> TCPStore:
        if self._store is None:
            self._store = TCPStore(self.host, 0, is_master=True, wait_for_workers=False,
                                   timeout=datetime.timedelta(seconds=self.timeout_s))
        return self._store

    def accepts(self, address: str, status: pb.GetStatusReply) -> bool:
        if self.tls or not status.collective_backends or self._excluded.get(address, 0.0) > time.monotonic():
            return False
        self._offered[address] = tuple(status.collective_backends)
        return True

    def forget(self, address: str) -> None:
        self._offered.pop(address, None)

    def exclude(self, addresses: list[str]) -> None:
        until = time.monotonic() + EXCLUDED_S
        self._excluded.update(dict.fromkeys(addresses, until))

    def group(self, members: tuple[str, ...]) -> Group:
        """The kept group of exactly `members`, else a new one."""
        return self.groups.group(members, lambda: self._new_group(members))

    def _new_group(self, members: tuple[str, ...]) -> Group:
        nccl = self.device.startswith("cuda") and all("nccl" in self._offered.get(a, ()) for a in members)
        return Group(self.store(), secrets.token_bytes(8), 0, len(members) + 1, "nccl" if nccl else "gloo",
                     self.timeout_s)

    def begin(self, push: Snapshot, targets: int) -> CollectiveTransfer:
        self.round_lock.acquire()
        try:
            return CollectiveTransfer(self, push, targets)
        except BaseException:
            self.round_lock.release()
            raise

    def close(self) -> None:
        self.groups.clear()
        self._store = None

"""The collective route (`Route.COLLECTIVE`), what both ends share: the bucket plan of a version, the weight
group's process group (gloo on CPU, NCCL between GPUs) and the round protocol on its rendezvous store.

The learner (rank 0, the root of every broadcast) and the receivers of a round form a process group of their
own, never torch's default one (which DeepSpeed owns in the learner): a `TCPStore` the learner serves, one
`PrefixStore` per group, and the backend class built directly on it, as vLLM's
`stateless_init_torch_distributed_process_group` does; broadcasts are called on that backend object.

A round (one version to the group's members) goes:

1. every member that reads the push's first tensor message says so on the store (`here_key`), whatever the
   receiver then decides (a refused push still takes part, so it never stalls the others);
2. the learner waits until every member is here, or one of their gRPC calls ended without it, or
   `JOIN_TIMEOUT_S`; then it writes the round's verdict (`go_key`): broadcast, or abandoned (every member
   then refuses with `collective_unavailable` and the pusher streams to it instead);
3. on go, a group not yet built is built (every member is here, so the rendezvous is quick) and the learner
   broadcasts the buckets in order, two in flight; every member receives all of them, draining those its
   receiver no longer reads.

The membership of a group is fixed: the learner builds a new group when the round's targets differ from every
group it keeps (a generator joining late; one that died), so a missing member costs one abandoned round and
never a hung learner: collective ops time out (`timeout_ms`), and a group whose op failed is dropped.

A failed or timed-out op raises a `RuntimeError` in the thread that waits on it, at both ends, and never takes
the process down: gloo raises by itself; an NCCL group is built with blocking waits (`NCCL_RAISES`), so
torch's watchdog thread, which by default tears the whole process down on a timed-out collective
(`TORCH_NCCL_ASYNC_ERROR_HANDLING=3`), is never started for it, and `Work.wait` blocks until the op ends or
the group's timeout passes, then aborts the communicator and raises `DistBackendError` (a `RuntimeError`).

Trust: the store and gloo's connections carry no token and no TLS (as torch.distributed everywhere): the
route is for the cluster's own network, and is not offered beside a TLS WeightSync. What a member receives is
checked against the checksums that came over the authenticated gRPC call.
"""

from __future__ import annotations

import datetime
import os
import threading
from collections import OrderedDict
from collections.abc import Callable, Hashable, Iterator, Mapping, Sequence
from contextlib import contextmanager
from dataclasses import dataclass

import torch
from torch.distributed import PrefixStore, Store, TCPStore

from asyncrlhf.weights.codec import WireTensor

GLOO, NCCL = "gloo", "nccl"
JOIN_TIMEOUT_S = 10.0  # every member of a round says it is here within this long, or the round is abandoned
GO, ABANDONED = "1", "0"  # the learner's verdict on a round (the store gives it back as bytes)
IN_FLIGHT = 2  # buckets in flight at once: one packed (or read) while the other is broadcast
KEPT_GROUPS = 2  # groups kept built: the live generators', and a late joiner's own catch-up push
# What makes an NCCL weight group's errors raise (see the module). ProcessGroupNCCL reads both in its
# constructor, for that group alone, so they are set only while one is built: DeepSpeed's groups in the
# learner and vLLM's in an engine keep torch's defaults. Blocking waits start no watchdog; clean-up-only
# error handling is what a watchdog would do if a torch version started one anyway (abort, never tear down).
NCCL_RAISES = {"TORCH_NCCL_BLOCKING_WAIT": "1", "TORCH_NCCL_ASYNC_ERROR_HANDLING": "2"}
_environ_lock = threading.Lock()


@dataclass(frozen=True)
class Plan:
    """A version's tensors packed in order into buckets of about `bucket_bytes` (a tensor larger than that
    gets a bucket of its own): `sizes[k]` bytes in bucket k; tensor i lies at `places[i]` (bucket, offset)."""

    sizes: tuple[int, ...]
    places: tuple[tuple[int, int], ...]

    @classmethod
    def of(cls, tensors: Sequence[WireTensor], bucket_bytes: int) -> Plan:
        sizes: list[int] = []
        places: list[tuple[int, int]] = []
        for t in tensors:
            n = t.data.nbytes
            if not sizes or (sizes[-1] and sizes[-1] + n > bucket_bytes):
                sizes.append(0)
            places.append((len(sizes) - 1, sizes[-1]))
            sizes[-1] += n
        return cls(tuple(sizes), tuple(places))

    def members(self, bucket: int) -> range:
        """The indices of the tensors in `bucket`."""
        inside = [i for i, (b, _) in enumerate(self.places) if b == bucket]
        return range(inside[0], inside[-1] + 1) if inside else range(0)


def resolved(device: str) -> str:
    """A configured device (`auto`, `cpu`, `cuda:1`) as the one a process uses."""
    if device == "auto":
        return "cuda" if torch.cuda.is_available() else "cpu"
    return device


def backends_of(device: str) -> tuple[str, ...]:
    """The backends a process whose tensors live on `device` can join a weight group with, preferred first."""
    if device.startswith("cuda") and torch.distributed.is_nccl_available():
        return NCCL, GLOO
    return (GLOO,)


def device_of(backend: str, device: str) -> torch.device:
    """Where a member's bucket buffers live: on its GPU for NCCL, in host memory for gloo."""
    return torch.device(device if backend == NCCL else "cpu")


def store_client(address: str, timeout_s: float) -> TCPStore:
    """A client of the learner's rendezvous store at `host:port`."""
    host, port = address.rsplit(":", 1)
    return TCPStore(host, int(port), is_master=False, wait_for_workers=False,
                    timeout=datetime.timedelta(seconds=timeout_s))


def group_store(store: Store, group: bytes) -> PrefixStore:
    """The keys of one group on the learner's store."""
    return PrefixStore(f"asyncrlhf-weights/{group.hex()}", store)


def here_key(round_id: int, rank: int) -> str:
    return f"round/{round_id}/here/{rank}"


def go_key(round_id: int) -> str:
    return f"round/{round_id}/go"


def process_group(backend: str, store: Store, rank: int, world_size: int, timeout_s: float):
    """The backend object of a weight group (its `broadcast` is called directly): built on the group's own
    store, outside torch's default group; blocks until every rank has built its own. gloo connects over the
    interface of the host's name (GLOO_SOCKET_IFNAME names another), as torch.distributed does."""
    from torch.distributed import distributed_c10d as c10d

    timeout = datetime.timedelta(seconds=timeout_s)
    prefixed = PrefixStore("pg", store)
    if backend == NCCL:
        options = c10d.ProcessGroupNCCL.Options()
        options._timeout = timeout  # noqa: SLF001  # torch's only way to set it (vLLM sets it so too)
        with environment(NCCL_RAISES):
            return c10d.ProcessGroupNCCL(prefixed, rank, world_size, options)
    return c10d.ProcessGroupGloo(prefixed, rank, world_size, timeout)


@contextmanager
def environment(values: Mapping[str, str]) -> Iterator[None]:
    """`values` in the process environment while the block runs; each variable as it was after."""
    with _environ_lock:
        before = {name: os.environ.get(name) for name in values}
        os.environ.update(values)
        try:
            yield
        finally:
            for name, value in before.items():
                if value is None:
                    os.environ.pop(name, None)
                else:
                    os.environ[name] = value


def broadcast(group, bucket: torch.Tensor):
    """Start broadcasting `bucket` from the learner (rank 0) to every member; the `Work` to wait on."""
    from torch.distributed import distributed_c10d as c10d

    options = c10d.BroadcastOptions()
    options.rootRank = 0
    return group.broadcast([bucket], options)


class Group:
    """One weight group at either end: its keys on the learner's `store`, this end's rank, and its process
    group once built. `rounds`: the rounds the learner began on it."""

    def __init__(self, store: Store, group_id: bytes, rank: int, world_size: int, backend: str,
                 timeout_s: float):
        self.id, self.keys = group_id, group_store(store, group_id)
        self.rank, self.world_size = rank, world_size
        self.backend, self.timeout_s = backend, timeout_s
        self.rounds = 0
        self.process_group = None

    def built(self):
        if self.process_group is None:
            self.process_group = process_group(self.backend, self.keys, self.rank, self.world_size,
                                               self.timeout_s)
        return self.process_group


class Kept:
    """The groups an end keeps built, by key, the last `KEPT_GROUPS` used, and its `IN_FLIGHT` bucket buffers
    (one round at a time uses them)."""

    def __init__(self) -> None:
        self._groups: OrderedDict[Hashable, Group] = OrderedDict()
        self._ring: list[torch.Tensor] = []
        self._lock = threading.Lock()

    def group(self, key: Hashable, build: Callable[[], Group]) -> Group:
        """The kept group of `key`, else a new one from `build` (the oldest kept is let go)."""
        with self._lock:
            if key not in self._groups:
                self._groups[key] = build()
            self._groups.move_to_end(key)
            while len(self._groups) > KEPT_GROUPS:
                self._groups.popitem(last=False)
            return self._groups[key]

    def drop(self, key: Hashable, group: Group) -> None:
        """Let `group` go (an op of it failed): its connections close, so its peers' ops fail at once."""
        group.process_group = None
        with self._lock:
            if self._groups.get(key) is group:
                del self._groups[key]

    def clear(self) -> None:
        with self._lock:
            self._groups.clear()

    def ring(self, nbytes: int, device: torch.device) -> list[torch.Tensor]:
        """`IN_FLIGHT` bucket buffers of at least `nbytes` on `device`."""
        if not self._ring or self._ring[0].numel() < nbytes or self._ring[0].device != device:
            self._ring = [torch.empty(nbytes, dtype=torch.uint8, device=device) for _ in range(IN_FLIGHT)]
        return self._ring

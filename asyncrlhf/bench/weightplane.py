"""The same-host weight plane, measured for `asyncrlhf bench transport`: the shared-memory push against a bare
memcpy of the same bytes, two local generators against one, and the time from a finished step to every
generator serving it.

Each generator is its own process (a WeightSync server over a model-less receiver), as in `asyncrlhf up`;
the pusher runs in this process, as the learner does.
"""

from __future__ import annotations

import math
import multiprocessing
import statistics
import time
from collections.abc import Callable, Mapping
from contextlib import ExitStack, contextmanager
from dataclasses import dataclass
from typing import Any

import torch

from asyncrlhf.version import PolicyVersion
from asyncrlhf.weights.access import ClientAccess, ServerAccess
from asyncrlhf.weights.pusher import PushStatus, PushTarget, WeightPusher
from asyncrlhf.weights.receiver import WeightReceiver
from asyncrlhf.weights.server import serve
from asyncrlhf.weights.target import swap_in

TOKEN = "bench"


class Tensors:
    """A WeightTarget over plain tensors (the bench has no model)."""

    def __init__(self, tensors: Mapping[str, torch.Tensor]):
        self.tensors = dict(tensors)

    def named_tensors(self) -> Mapping[str, torch.Tensor]:
        return self.tensors

    def apply_weights(
        self, tensors: Mapping[str, torch.Tensor], version: PolicyVersion, *, adopt: bool = False
    ) -> dict[str, torch.Tensor]:
        return swap_in(self.tensors, tensors, adopt=adopt)


def state_dict(params: int, tensor_params: int = 4 << 20) -> dict[str, torch.Tensor]:
    n = max(1, math.ceil(params / tensor_params))
    return {f"layers.{i}.weight": torch.randn(tensor_params // 2048, 2048) for i in range(n)}


def _generator(params: int, conn) -> None:
    """A light generator: a WeightSync server over a receiver, no model, until the parent says stop."""
    torch.set_num_threads(1)
    receiver = WeightReceiver(Tensors({k: torch.zeros_like(v) for k, v in state_dict(params).items()}))
    server, port = serve(receiver, access=ServerAccess(TOKEN))
    conn.send(port)
    conn.recv()
    server.stop(0).wait(10)  # exiting while gRPC still shuts down can abort the process


def generators(params: int, n: int):
    """`n` generator processes; yields their addresses."""
    return receiver_processes(_generator, params, n)


@contextmanager
def receiver_processes(target: Callable[[Any, Any], None], arg: Any, n: int):
    """`n` processes running `target(arg, conn)`, each sending its gRPC port on `conn` and serving until it
    reads "stop"; yields their addresses."""
    ctx = multiprocessing.get_context("spawn")
    with ExitStack() as stack:
        addresses = []
        for _ in range(n):
            parent, child = ctx.Pipe()
            proc = ctx.Process(target=target, args=(arg, child), daemon=True)
            proc.start()
            stack.callback(_stop, proc, parent)
            if not parent.poll(120):
                raise RuntimeError("bench generator process did not start within 120 s")
            addresses.append(f"127.0.0.1:{parent.recv()}")
        yield addresses


def _stop(proc, conn) -> None:
    conn.send("stop")
    proc.join(30)
    if proc.is_alive():
        proc.kill()


def memcpy_gbps(state: Mapping[str, torch.Tensor]) -> float:
    """One copy of every tensor into a preallocated, already-touched buffer (as the receivers' staging is
    after the first push): the floor of any same-host move. A fresh buffer would time its page faults too
    (docs/benchmarks.md gives the figures), and flatter every push compared with it."""
    dst = {k: torch.empty_like(v) for k, v in state.items()}
    for k, v in state.items():
        dst[k].copy_(v)  # first touch, not timed
    total = sum(v.numel() * v.element_size() for v in state.values())
    start = time.perf_counter()
    for k, v in state.items():
        dst[k].copy_(v)
    return total / (time.perf_counter() - start) / 1e9


def _timed_push(pusher: WeightPusher, state, version: int, addresses) -> float:
    targets = [PushTarget(f"g{i}", a) for i, a in enumerate(addresses)]
    start = time.perf_counter()
    outcomes = pusher.push(state, PolicyVersion(0, version), targets)
    elapsed = time.perf_counter() - start
    bad = [o for o in outcomes if o.status != PushStatus.OK]
    if bad:
        raise RuntimeError(f"bench push failed: {bad[0]}")
    return elapsed


@dataclass(frozen=True)
class LocalResult:
    shm_push_gbps: float  # one generator
    memcpy_gbps: float
    two_generators_time_ratio: float  # push to two local generators / push to one
    step_to_serve_s: float  # weights of a finished step -> both generators serving them (cast, write, verify)


def bench_local(params: int, repeats: int) -> LocalResult:
    state = state_dict(params)
    total = sum(t.numel() * t.element_size() for t in state.values())
    one, two, copies = [], [], []
    with generators(params, 2) as addresses, \
            WeightPusher(ClientAccess(TOKEN), dtype="float32", timeout_s=600) as pusher:
        version = 0
        for _ in range(repeats + 1):  # the first round allocates staging; not counted
            copies.append(memcpy_gbps(state))
            one.append(_timed_push(pusher, state, version := version + 1, addresses[:1]))
            two.append(_timed_push(pusher, state, version := version + 1, addresses))
    one_s, two_s = statistics.median(one[1:]), statistics.median(two[1:])
    return LocalResult(total / one_s / 1e9, statistics.median(copies[1:]), two_s / one_s, two_s)

"""The relay, measured for `asyncrlhf bench transport`: versions pushed through the relay tree to light
receivers on loopback (16 by default, `learner.relay_fanout` 2), the pusher seeing no shared memory, as
across hosts. Reported: the learner's tensor bytes per version over the model's (the target: <= 2 however
many receivers), and the time from the push's start to the last receiver's commit (every receiver and the
pusher share this machine's cores, so on a small machine that time says little about a cluster; the bytes
hold anywhere).

Each receiver is a WeightSync server over a model-less receiver, with a relay, as a generator runs them;
several share a process (receiver i in process i mod `processes`, so a receiver and the ones it relays to
are in different processes); the pusher runs in this process, as the learner does.
"""

from __future__ import annotations

import multiprocessing
import statistics
import time
from contextlib import ExitStack, contextmanager
from dataclasses import dataclass

import torch

from asyncrlhf.bench.weightplane import TOKEN, Tensors, state_dict
from asyncrlhf.version import PolicyVersion
from asyncrlhf.weights.access import ClientAccess, ServerAccess
from asyncrlhf.weights.channel_read import DataListener
from asyncrlhf.weights.pusher import PushStatus, PushTarget, WeightPusher
from asyncrlhf.weights.receiver import NO_VERSION, WeightReceiver
from asyncrlhf.weights.relay import Relay, TreePush, relay_pusher
from asyncrlhf.weights.server import serve
from asyncrlhf.weights.vocabulary import Route


def _receivers(params: int, count: int, conn) -> None:
    """`count` light receivers with relays in one process, until the parent says stop."""
    torch.set_num_threads(1)
    running = []
    for _ in range(count):
        data = DataListener()  # as a generator: with a data channel
        receiver = WeightReceiver(Tensors({k: torch.zeros_like(v) for k, v in state_dict(params).items()}),
                                  NO_VERSION, data=data)
        relay = Relay(relay_pusher(ClientAccess(TOKEN), 4 << 20, timeout_s=600))
        server, port = serve(receiver, access=ServerAccess(TOKEN), relay=relay)
        running.append((server, relay, data, port))
    conn.send([port for *_, port in running])
    conn.recv()
    for server, relay, data, _ in running:
        relay.close()
        server.stop(0).wait(10)  # exiting while gRPC still shuts down can abort the process
        data.close()


@contextmanager
def receivers(params: int, n: int, processes: int):
    """`n` light receivers in `processes` processes; yields their addresses, receiver i in process i mod
    `processes`."""
    ctx = multiprocessing.get_context("spawn")
    counts = [len(range(p, n, processes)) for p in range(processes)]
    with ExitStack() as stack:
        conns = []
        for count in counts:
            parent, child = ctx.Pipe()
            proc = ctx.Process(target=_receivers, args=(params, count, child), daemon=True)
            proc.start()
            stack.callback(_stop, proc, parent)
            conns.append(parent)
        ports = []
        for parent in conns:
            if not parent.poll(180):
                raise RuntimeError("bench receiver process did not start within 180 s")
            ports.append(parent.recv())
        yield [f"127.0.0.1:{ports[i % processes][i // processes]}" for i in range(n)]


def _stop(proc, conn) -> None:
    conn.send("stop")
    proc.join(30)
    if proc.is_alive():
        proc.kill()


@dataclass(frozen=True)
class RelayResult:
    learner_bytes_ratio: float  # tensor bytes the pusher sent for a version / the version's tensor bytes
    last_commit_s: float  # from the push's start to the last receiver's commit


def bench_relay(params: int, repeats: int, n: int = 16, fanout: int = 2, processes: int = 4) -> RelayResult:
    state = state_dict(params)
    total = sum(t.numel() * t.element_size() for t in state.values())
    ratios, last = [], []
    with receivers(params, n, min(processes, n)) as addresses, \
            WeightPusher(ClientAccess(TOKEN), dtype="float32", timeout_s=600,
                         routes=(Route.DATA, Route.STREAM)) as pusher:
        targets = [PushTarget(f"r{i}", a) for i, a in enumerate(addresses)]
        for version in range(1, repeats + 2):  # the first version allocates staging; not counted
            start = time.time()
            push = pusher.prepare(state, PolicyVersion(0, version))
            outcomes = TreePush(pusher, push, fanout).run(targets)
            bad = [o for o in outcomes if o.status != PushStatus.OK]
            if bad:
                raise RuntimeError(f"bench relay push failed: {bad[0]}")
            commits = [pusher.get_status(a).updated_at for a in addresses]
            ratios.append(sum(o.bytes for o in outcomes) / total)
            last.append(max(commits) - start)
    return RelayResult(statistics.median(ratios[1:]), statistics.median(last[1:]))

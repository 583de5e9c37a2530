"""WeightSync wiring: the gRPC server that receives pushes into the backend, and the registry heartbeat.

A push is staged and verified by `asyncrlhf.weights.receiver.WeightReceiver`; on commit it calls
`WeightSwap.apply_weights` with the verified `PolicyVersion`, which swaps the tensors in and serves that
version (step and lineage together), all before the pusher gets its reply. In batch mode it takes the backend
gate (so it waits for the batch in progress, and goes before the next one); in continuous mode the swap is
work for the engine's thread (`VLLMStepEngine.call`): the loop runs it between two engine steps, so the
version a step's tokens are labelled with is always the one its weights are.
"""

from __future__ import annotations

import contextlib
import socket
import threading
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Protocol, TypeVar

import grpc
import redis
import torch

from asyncrlhf.config import Config
from asyncrlhf.cores import on_fresh_thread
from asyncrlhf.registry import Heartbeat, Registry
from asyncrlhf.sampling import Backend
from asyncrlhf.service import check_bind
from asyncrlhf.serving.gate import BackendGate
from asyncrlhf.streams.holding import PendingHolder
from asyncrlhf.version import PolicyVersion
from asyncrlhf.weights.access import ServerAccess
from asyncrlhf.weights.channel_read import DataListener
from asyncrlhf.weights.collective import resolved
from asyncrlhf.weights.collective_member import CollectiveMember, Member
from asyncrlhf.weights.receiver import NO_VERSION, WeightReceiver
from asyncrlhf.weights.relay import Relay
from asyncrlhf.weights.server import serve
from services.generator.metrics import GeneratorMetrics

_WILDCARD_HOSTS = ("0.0.0.0", "::", "")
T = TypeVar("T")


class EngineThread(Protocol):
    """Where continuous mode's swaps run: the thread that talks to the engine (`VLLMStepEngine`)."""

    def call(self, fn: Callable[[], T]) -> T: ...


class WeightSwap:
    """The generator's `WeightTarget`: the backend's, applied between generation batches (under the gate) or
    between two engine steps (by `engine`, in continuous mode), and counted. While a swap waits for the gate
    or the engine's thread, and while it runs, the loop waits: `pending` holds the loop's groups meanwhile."""

    def __init__(self, backend: Backend, gate: BackendGate, metrics: GeneratorMetrics,
                 on_applied: Callable[[int], None] = lambda version: None,
                 pending: PendingHolder | None = None, engine: EngineThread | None = None):
        self.backend, self.gate, self.metrics, self.on_applied = backend, gate, metrics, on_applied
        self.pending, self.engine = pending, engine
        self.arrived = threading.Event()  # set once the first version is live
        self.served = NO_VERSION  # changes with the weights: under the gate, or on the engine's thread

    def _swap(self, tensors: Mapping[str, torch.Tensor], version: PolicyVersion,
              adopt: bool) -> Mapping[str, torch.Tensor] | None:
        replaced = self.backend.apply_weights(tensors, version, adopt=adopt)
        self.served = version
        return replaced

    @property
    def lineage(self) -> int:
        """The learner lineage of the version served."""
        return self.served.lineage

    def named_tensors(self) -> Mapping[str, torch.Tensor]:
        return self.backend.named_tensors()

    def apply_weights(
        self, tensors: Mapping[str, torch.Tensor], version: PolicyVersion, *, adopt: bool = False
    ) -> Mapping[str, torch.Tensor] | None:
        start = time.perf_counter()
        with self.pending.held() if self.pending is not None else contextlib.nullcontext():
            if self.engine is not None:
                replaced = self.engine.call(lambda: self._swap(tensors, version, adopt))
            else:
                with self.gate.swapping():  # torch work on a thread that exits: see `on_fresh_thread`
                    replaced = on_fresh_thread(lambda: self._swap(tensors, version, adopt))
        self.metrics.weight_apply_seconds.observe(time.perf_counter() - start)
        self.metrics.weight_updates.inc()
        self.metrics.version.set(version.step)
        self.arrived.set()
        self.on_applied(version.step)
        return replaced


@dataclass
class WeightSyncServer:
    server: grpc.Server
    port: int
    address: str  # host:port the learner dials
    relay: Relay  # forwards committed versions to other generators when a push asks (learner.relay_fanout)
    data: DataListener | None = None  # the data channel pushes' tensor bytes come on (generator.data_channel)
    collective: Member | None = None  # the weight groups it joins (generator.collective)

    def stop(self, grace_s: float = 2.0) -> None:
        self.server.stop(grace_s).wait(grace_s + 1)
        self.relay.close()
        if self.data is not None:
            self.data.close()
        if self.collective is not None:
            self.collective.close()


def start_weight_sync(cfg: Config, swap: WeightSwap) -> WeightSyncServer:
    """Serve WeightSync on `generator.grpc_host:grpc_port` (token-checked when `run.token` is set), relaying
    with the run's token and TLS client settings."""
    host = cfg.generator.grpc_host
    check_bind(host, cfg, "WeightSync")
    access = ServerAccess.from_config(cfg)
    # tensor bytes beside the gRPC call, over TLS from the same files when WeightSync is
    data = DataListener(host, cfg.generator.data_port, tls=access.data_tls) if cfg.generator.data_channel \
        else None
    # gloo and NCCL carry no TLS: no weight group beside a TLS WeightSync
    # the engine's worker joins weight groups itself where its hop takes the rounds there, else this process
    hop = swap.backend.hop
    engine = hop.rounds if hop is not None else None
    collective = (engine or CollectiveMember(resolved(cfg.generator.device))) \
        if cfg.generator.collective and access.credentials is None else None
    # After a restart: no version until the learner pushes one.
    receiver = WeightReceiver(swap, NO_VERSION, data=data, collective=collective)
    relay = Relay.from_config(cfg)
    try:
        server, port = serve(receiver, host, cfg.generator.grpc_port, access, relay=relay)
    except BaseException:
        if data is not None:
            data.close()
        raise
    return WeightSyncServer(server, port, f"{advertised_host(cfg)}:{port}", relay, data, collective)


def advertised_host(cfg: Config) -> str:
    """What the learner dials: `advertise_host`, else the bind address (the host name for a wildcard bind)."""
    if cfg.generator.advertise_host:
        return cfg.generator.advertise_host
    host = cfg.generator.grpc_host
    return socket.gethostname() if host in _WILDCARD_HOSTS else host


def start_heartbeat(cfg: Config, client: redis.Redis, generator_id: str, address: str,
                    version: Callable[[], PolicyVersion]) -> Heartbeat:
    """Register `{id, address, version}` now and every `heartbeat_s`; the entry expires `registry_ttl_s`
    after the last beat."""
    registry = Registry(client, cfg.run.name, ttl_s=cfg.generator.registry_ttl_s)
    return Heartbeat(registry, generator_id, address, version, period_s=cfg.generator.heartbeat_s).start()

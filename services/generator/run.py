"""One generator process, wired from the config: backend, gate, WeightSync server, registry heartbeat,
HTTP app and the loop. `__main__` runs it; the benchmark and tests can inject a backend they built."""

from __future__ import annotations

import logging
import os
import socket
import threading
import uuid

import redis

from asyncrlhf.config import Config
from asyncrlhf.cores import CoreShare
from asyncrlhf.models import load_tokenizer
from asyncrlhf.registry import Heartbeat
from asyncrlhf.sampling import Backend, create_backend
from asyncrlhf.sampling.hf import HFBackend
from asyncrlhf.sampling.hops.engine_member import EngineMember
from asyncrlhf.sampling.vllm import VLLMBackend
from asyncrlhf.sampling.vllm_stepping import VLLMStepEngine
from asyncrlhf.service import HttpServer, check_bind
from asyncrlhf.serving.gate import BackendGate
from asyncrlhf.streams import GENERATOR_GROUP, PROMPTS, ROLLOUTS, RunStreams, connect
from asyncrlhf.streams.holding import PendingHolder
from services.generator.continuous import ContinuousLoop
from services.generator.episodes import EpisodeGroups
from services.generator.http import make_http_app
from services.generator.loop import BatchLoop, GroupKind, Loop, LoopContext, PromptIO
from services.generator.metrics import GeneratorMetrics
from services.generator.samples import SingleTurn
from services.generator.server import WeightSwap, WeightSyncServer, start_heartbeat, start_weight_sync

log = logging.getLogger(__name__)


def new_generator_id() -> str:
    """Unique per process: a restarted generator is a new consumer (its old pending entries get
    re-claimed)."""
    return f"gen-{socket.gethostname()}-{os.getpid()}-{uuid.uuid4().hex[:4]}"


HF_BATCH_ONLY = ("generator.mode=continuous needs a step-wise engine, which the HF backend does not have: "
                 "this generator runs batch mode (groups written when the batch's longest sample ends, "
                 "pushes applied between batches); use generator.backend=vllm for continuous mode")


def effective_mode(cfg: Config, backend: Backend) -> str:
    """The mode this generator runs: `continuous` only on the vLLM backend (HF_BATCH_ONLY says why), for
    single-turn samples and for episodes alike."""
    if cfg.generator.mode != "continuous":
        return "batch"
    if isinstance(backend, VLLMBackend):
        return "continuous"
    log.warning(HF_BATCH_ONLY)
    return "batch"


def group_kind(ctx: LoopContext) -> GroupKind:
    """What a prompt group is: k episodes with `task.env`, else k single-turn samples."""
    return EpisodeGroups(ctx) if ctx.cfg.task.env.kind != "none" else SingleTurn(ctx)


def weight_groups(server: WeightSyncServer) -> str:
    """Who takes part in the learner's weight groups for this generator, as the start-up line says it."""
    member = server.collective
    if member is None:
        return "no weight group (generator.collective off, or TLS)"
    who = "the engine's worker" if isinstance(member, EngineMember) else "this process"
    return f"weight groups joined by {who} ({', '.join(member.backends)})"


class GeneratorService:
    def __init__(self, cfg: Config, *, backend: Backend | None = None, tokenizer=None,
                 generator_id: str | None = None, client: redis.Redis | None = None):
        self.cfg = cfg
        self.id = generator_id or new_generator_id()
        self.tokenizer = tokenizer if tokenizer is not None else load_tokenizer(cfg.model)
        self.backend = backend if backend is not None else create_backend(cfg, self.tokenizer)
        self.gate = BackendGate()
        self.metrics = GeneratorMetrics(self.id)
        self.client = client or connect(cfg.redis)
        self.streams = RunStreams.from_config(cfg, self.client)
        self.cores = CoreShare.from_env(self.id)
        if self.cores and isinstance(self.backend, HFBackend):  # cores move between decoding steps
            self.backend.step_hook = self.cores.adjust
        self.mode = effective_mode(cfg, self.backend)
        # continuous mode: one thread talks to the engine, the loop's (this one: it builds and runs it)
        engine = VLLMStepEngine(self.backend, seed=cfg.run.seed) if self.mode == "continuous" else None
        prompts = self.streams.consumer(PROMPTS, GENERATOR_GROUP, self.id)
        self.swap = WeightSwap(self.backend, self.gate, self.metrics, on_applied=self._announce,
                               pending=PendingHolder(prompts, cfg.redis.claim_idle_ms), engine=engine)
        io = PromptIO(prompts, self.streams.producer(ROLLOUTS),
                      pending=lambda: self.streams.stats(PROMPTS, GENERATOR_GROUP).length,
                      handon=self.streams.producer(PROMPTS), partials=self.streams.partials())
        self.api_gate = self.gate
        ctx = LoopContext(cfg, self.swap, io, self.tokenizer, self.id, cores=self.cores)
        self.loop: Loop
        if engine is not None:
            assert isinstance(self.backend, VLLMBackend)
            self.backend.driver = engine  # the API's requests join the loop's engine steps
            self.backend.recompute_inflight = cfg.generator.vllm.inflight_kv == "recompute"
            self.api_gate = BackendGate()  # API batches queue among themselves; the engine's steps are shared
            self.loop = ContinuousLoop(ctx, group_kind(ctx), engine)
        else:
            self.loop = BatchLoop(ctx, group_kind(ctx))
        self.weight_sync: WeightSyncServer | None = None
        self.heartbeat: Heartbeat | None = None
        self.http: HttpServer | None = None

    def start(self) -> GeneratorService:
        """Serve WeightSync, register in the registry (version 0 until the first push), serve HTTP."""
        check_bind(self.cfg.generator.http_host, self.cfg, "the generator's HTTP server")
        self.weight_sync = start_weight_sync(self.cfg, self.swap)
        self.heartbeat = start_heartbeat(self.cfg, self.client, self.id, self.weight_sync.address,
                                         lambda: self.swap.served)
        app = make_http_app(self.cfg, self.metrics, self.backend, self.api_gate, self.tokenizer, self.id,
                            self.ready)
        self.http = HttpServer(app, self.cfg.generator.http_host, self.cfg.generator.http_port).start()
        log.info("generator %s (%s mode): WeightSync on %s, HTTP on %s, %s; waiting for the first weight "
                 "push", self.id, self.mode, self.weight_sync.address, self.http.url,
                 weight_groups(self.weight_sync))
        return self

    def run(self, stop: threading.Event) -> None:
        self.loop.run(stop)

    def ready(self) -> tuple[bool, str]:
        self.client.ping()
        if self.backend.version == 0:
            return False, "waiting for the learner's first weight push"
        return True, f"serving policy version {self.backend.version}"

    def close(self) -> None:
        if self.heartbeat is not None:
            self.heartbeat.stop()
        if self.weight_sync is not None:
            self.weight_sync.stop()
        if self.http is not None:
            self.http.stop()
        self.loop.close()

    def _announce(self, version: int) -> None:
        """Tell the registry about a new version at once rather than at the next beat."""
        log.info("generator %s now serves policy version %d", self.id, version)
        if self.heartbeat is not None:
            try:
                self.heartbeat.beat()
            except redis.RedisError as err:
                log.warning("could not announce version %d (the next heartbeat will): %s", version, err)

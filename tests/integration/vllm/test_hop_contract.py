"""The engine-hop contract: every hop from the generator into vLLM's engine (in process, shared memory, file,
worker round), full weights and unmerged LoRA adapters alike, against vLLM's CPU engine:

- a pushed version lands bit-exact: the engine serves the pushed model (its sampled log-probs are HF's on the
  same tensors), and a push of the weights it started with gives back, bit for bit, the scores vLLM's own
  loader gave at its start (a LoRA engine: the learner's first adapter, B = 0, gives the base model's);
- a push the workers refuse (bytes spoiled on the way: a flipped byte in the segment, a truncated file, a
  bucket flipped in the broadcast; for adapters also a module vLLM serves no LoRA on) keeps the old version
  serving, its scores bit for bit;
- no file where none is promised: while a version lands, nothing is created or written in the cache
  directory (the engine's work directory within it) or /dev/shm, but the file hop's one push file, which is
  gone once the version landed.

Four engines (full weights or LoRA, in this process or in processes of their own), each started once and
closed before the next: the cases are ordered by engine. An engine's start is what takes long (7-19 s on
this 2-core host when quiet, 1.5-2.5 min when loaded), so each case is one test that checks all three. A
new hop is one more row of `CASES`."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest
import torch
from watchdog.observers import Observer

from asyncrlhf.config import Config, SamplingConfig
from asyncrlhf.models import encode_prompts, load_policy, load_tokenizer
from asyncrlhf.sampling.hops.file import PUSH_FILE, File
from asyncrlhf.sampling.hops.hop import EngineHop, HopKind
from asyncrlhf.sampling.hops.shared_memory import SharedMemory
from asyncrlhf.version import PolicyVersion
from asyncrlhf.weights.codec import adapter_tensors
from asyncrlhf.weights.collective_sender import CollectiveSender
from asyncrlhf.weights.pusher import PushOutcome, PushTarget, WeightPusher
from asyncrlhf.weights.receiver import WeightReceiver
from asyncrlhf.weights.server import serve
from asyncrlhf.weights.shm import SHM_DIR
from asyncrlhf.weights.vocabulary import Reason, Route
from tests.integration.vllm.helpers import PARITY_ATOL, Corrupting, Writes, max_gap, vllm_config
from tests.integration.vllm.test_lora import random_adapter
from tests.integration.weights.routes import FlippingSender
from tests.unit.generator.peaked import perturbed_state_dict

pytestmark = [pytest.mark.integration, pytest.mark.vllm]
SAMPLING = SamplingConfig(temperature=0.8, max_new_tokens=6)
LORA = ["learner.lora.enabled=true", "learner.lora.r=8", "learner.lora.alpha=16",
        "generator.vllm.merge_lora=false"]
BUCKET = 64 << 10  # the tiny model (451 KiB) in several buckets of the worker round
TRUNCATED = "(?i)incomplete|invalid|deserializ|truncat|metadata|eof|size"  # safetensors' refusal


class Truncated(File):
    """A file hop whose push file loses its end between the write and the workers' read (a disk filling)."""

    def write(self, tensors):
        path = super().write(tensors)
        with open(path, "r+b") as f:
            f.truncate(Path(path).stat().st_size // 2)
        return path


@dataclass
class Engine:
    """One engine, the model it started with, and what it scored then (vLLM's own loader's weights)."""

    cfg: Config
    cache: Path
    backend: Any
    prompts: list[list[int]]
    model: torch.nn.Module  # the learner's model (LoRA-wrapped in a LoRA run): each version derives from it
    first: dict[str, torch.Tensor] = field(default_factory=dict)  # the start's, as the learner pushes them
    started: list[float] = field(default_factory=list)
    seed: int = 0

    def scores(self) -> list[float]:
        """Each prompt token's log-prob under the served weights (`score_tokens`: no sampling)."""
        return [lp for seq in self.backend.score_tokens(self.prompts, 1) for lp, _ in seq]

    def other_version(self) -> dict[str, torch.Tensor]:
        """A version of its own: another adapter, or the model's weights with seeded noise."""
        self.seed += 1
        if self.cfg.learner.lora.enabled:
            return random_adapter(self.model, self.seed)
        return perturbed_state_dict(self.model, seed=self.seed, scale=0.2)

    def next_version(self) -> PolicyVersion:
        return PolicyVersion(0, self.backend.version + 1)


class Engines:
    """The module's engines, one alive at a time (`get` closes the last when another is asked for)."""

    def __init__(self, root: Path):
        self.root = root
        self.key: tuple[bool, bool] | None = None
        self.engine: Engine | None = None

    def get(self, lora: bool, in_process: bool) -> Engine:
        from asyncrlhf.sampling.vllm import VLLMBackend

        if self.key != (lora, in_process) or self.engine is None:
            self.close()
            cache = self.root / f"{'lora' if lora else 'full'}-{'in' if in_process else 'out'}"
            cfg = vllm_config(cache, *(LORA if lora else []),
                              f"generator.vllm.engine_in_process={str(in_process).lower()}")
            tokenizer = load_tokenizer(cfg.model)
            backend = VLLMBackend.from_config(cfg, tokenizer)
            prompts = encode_prompts(tokenizer, ["hello", "a longer prompt than that"], cfg.model)
            model = load_policy(cfg.model, lora=cfg.learner.lora if lora else None).eval()
            state = model.state_dict()  # a LoRA run's first adapter: B = 0, the base model's outputs
            first = {n: t.clone() for n, t in (adapter_tensors(state) if lora else state).items()}
            self.key, self.engine = (lora, in_process), Engine(cfg, cache, backend, prompts, model, first)
            self.engine.started = self.engine.scores()
        return self.engine

    def close(self) -> None:
        if self.engine is not None:
            self.engine.backend.close()
            self.key = self.engine = None


@pytest.fixture(scope="module")
def engines(tmp_path_factory) -> Iterator[Engines]:
    held = Engines(tmp_path_factory.mktemp("hops"))
    yield held
    held.close()


@dataclass(frozen=True)
class Case:
    """One hop on one engine: how it is put in place of the engine's own, and how its bytes are spoiled on
    the way (`spoiled`: None where none travel; the worker round's are spoiled in the learner's broadcast)."""

    kind: HopKind
    lora: bool

    @property
    def in_process(self) -> bool:
        return self.kind is HopKind.IN_PROCESS

    def hop(self, engine: Engine) -> EngineHop:
        own = engine.backend.hop
        made: dict[HopKind, Callable[[], EngineHop]] = {
            HopKind.IN_PROCESS: lambda: own, HopKind.WORKER_ROUND: lambda: own,
            HopKind.SHM: SharedMemory, HopKind.FILE: lambda: File(engine.backend.work_dir)}
        return made[self.kind]()

    def spoiled(self, engine: Engine) -> tuple[EngineHop, str] | None:
        """A hop whose bytes change between the generator's write and the workers' read, and what the
        workers' refusal says."""
        made: dict[HopKind, Callable[[], tuple[EngineHop, str] | None]] = {
            HopKind.IN_PROCESS: lambda: None, HopKind.WORKER_ROUND: lambda: None,
            HopKind.SHM: lambda: (SharedMemory(Corrupting()), "not those the generator verified"),
            HopKind.FILE: lambda: (Truncated(engine.backend.work_dir), TRUNCATED)}
        return made[self.kind]()


CASES = [Case(HopKind.SHM, False), Case(HopKind.FILE, False), Case(HopKind.WORKER_ROUND, False),
         Case(HopKind.IN_PROCESS, False),
         Case(HopKind.SHM, True), Case(HopKind.FILE, True), Case(HopKind.IN_PROCESS, True)]


@pytest.fixture(params=CASES, ids=lambda c: f"{c.kind.value}-{'lora' if c.lora else 'full'}")
def hop_case(request, engines) -> Iterator[tuple[Case, Engine]]:
    """The engine of the case with the case's hop in place; the engine's own hop restored after it."""
    case: Case = request.param
    engine = engines.get(case.lora, case.in_process)
    own = engine.backend.hop
    expected = HopKind.IN_PROCESS if case.in_process else HopKind.SHM if case.lora else HopKind.WORKER_ROUND
    assert own.kind is expected  # the factory's choice for this engine
    hop = case.hop(engine)
    engine.backend.hop = hop
    try:
        yield case, engine
    finally:
        engine.backend.hop = own
        if hop is not own:
            hop.close()


def push(case: Case, engine: Engine, weights: dict[str, torch.Tensor]) -> None:
    """`weights` as the next version, by the case's hop: handed to the backend as the receiver does, or, the
    worker round, broadcast by the learner into the worker; raises if the workers refuse it."""
    version = engine.next_version()
    if case.kind is HopKind.WORKER_ROUND:
        outcome = broadcast(engine, weights, version, CollectiveSender(bucket_bytes=BUCKET, timeout_s=60.0))
        assert (outcome.status, outcome.route) == ("ok", Route.COLLECTIVE), outcome.detail
    else:
        engine.backend.apply_weights(weights, version)


def broadcast(engine: Engine, weights: dict[str, torch.Tensor], version: PolicyVersion,
              sender: CollectiveSender) -> PushOutcome:
    """A push over the collective route (gloo) to a receiver whose rounds the engine's worker takes."""
    server, port = serve(WeightReceiver(engine.backend, collective=engine.backend.hop.rounds))
    try:
        with WeightPusher(route_senders=[sender], timeout_s=120) as pusher:
            (outcome,) = pusher.push(weights, version, [PushTarget("vllm-hop", f"127.0.0.1:{port}")])
    finally:
        server.stop(0)
    return outcome


def test_every_hop_lands_bit_exact_refuses_spoiled_bytes_and_makes_no_file_unpromised(hop_case):
    """One test per hop and engine, the checks in the module's order (each starts from the last's state)."""
    case, engine = hop_case
    backend, learner = engine.backend, engine.model
    other = engine.other_version()
    push(case, engine, other)  # the first push may make the hop's segment
    learner.load_state_dict(other, strict=False)
    groups = backend.generate(engine.prompts, 2, SAMPLING)
    assert max_gap(learner, engine.prompts, groups, SAMPLING) <= PARITY_ATOL  # the pushed model serves
    assert engine.scores() != engine.started

    writes, observer = Writes(), Observer()
    observer.schedule(writes, str(engine.cache), recursive=True)
    observer.schedule(writes, str(SHM_DIR), recursive=False)
    observer.start()
    try:
        push(case, engine, engine.first)
        writes.settle(engine.cache)
    finally:
        observer.stop()
        observer.join()
    assert engine.scores() == engine.started  # bit for bit what vLLM's own loader served
    files = {Path(event.split(" ", 1)[1]) for event in writes.take()}
    if case.kind is HopKind.FILE:  # its push file (safetensors writes it by way of a temporary one)...
        assert backend.work_dir / PUSH_FILE in files and {f.parent for f in files} == {backend.work_dir}
    else:
        assert files == set()
    assert list(backend.work_dir.iterdir()) == []  # ...gone once the version landed
    if case.lora:
        from asyncrlhf.sampling.vllm import ADAPTER_ID

        assert set(backend.llm.llm_engine.list_loras()) == {ADAPTER_ID}  # in place of the last one

    served = backend.version
    spoiled = case.spoiled(engine)
    if spoiled is not None:
        own, (backend.hop, refusal) = backend.hop, spoiled
        try:
            with pytest.raises(Exception, match=refusal):
                push(case, engine, engine.other_version())
        finally:
            backend.hop.close()
            backend.hop = own
    if case.kind is HopKind.WORKER_ROUND:
        outcome = broadcast(engine, engine.other_version(), engine.next_version(),
                            FlippingSender(bucket_bytes=BUCKET, timeout_s=60.0))
        assert (outcome.status, outcome.reason) == ("rejected", Reason.BAD_CHECKSUM), outcome.detail
        assert "bucket 1 as the worker received it" in outcome.detail
    if case.lora:  # a module vLLM serves no LoRA on: refused before the adapter in service is removed
        stray = {**engine.other_version(),
                 "base_model.model.model.norm.lora_A.default.weight": next(iter(learner.parameters()))}
        with pytest.raises(Exception, match="not among those vLLM serves LoRA on"):
            push(case, engine, stray)
    # the in-process hop with full weights hands the worker the receiver's verified tensors themselves: no
    # bytes travel that could be spoiled (the receiver's refusals: tests/integration/weights)
    assert backend.version == served
    assert engine.scores() == engine.started  # bit for bit: nothing of a refused push was loaded

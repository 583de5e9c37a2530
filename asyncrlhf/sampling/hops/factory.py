"""The one place a vLLM engine's hop is chosen, from the config, once, when the engine starts."""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path
from typing import Any

from asyncrlhf.config import Config, EngineHandoff
from asyncrlhf.sampling.hops.file import File
from asyncrlhf.sampling.hops.hop import EngineHop
from asyncrlhf.sampling.hops.in_process import InProcess
from asyncrlhf.sampling.hops.shared_memory import SharedMemory, available
from asyncrlhf.sampling.hops.worker_round import WorkerRound


def engine_hop(cfg: Config, env: Mapping[str, str], llm: Any, work_dir: Path) -> EngineHop:
    """The hop of the engine `llm`, started with `env` (`vllm_engine.engine_settings`): in process where its
    one worker runs here; else the worker round where its worker takes the collective route's rounds
    (`worker_joins`), handing over the versions whose bytes reach this process anyway by shared memory or a
    file (`generator.vllm.handoff`, `shared_handoff`) as it does without one."""
    if in_process(cfg, env):
        return InProcess()
    handed: EngineHop = SharedMemory() if shared_handoff(cfg) else File(work_dir)
    return WorkerRound.joined(llm, handed) if worker_joins(cfg) else handed


def in_process(cfg: Config, env: Mapping[str, str]) -> bool:
    """Whether the engine core and its only worker run in this process (`engine_settings`' env): then a push
    hands them tensors, not a file."""
    return env.get("VLLM_ENABLE_V1_MULTIPROCESSING") == "0" and cfg.generator.tensor_parallel_size == 1


def shared_handoff(cfg: Config) -> bool:
    """Whether an engine out of this process gets pushes through shared memory (`generator.vllm.handoff`),
    not a file."""
    choice = cfg.generator.vllm.handoff
    if choice is EngineHandoff.SHM and not available():
        raise RuntimeError("generator.vllm.handoff=shm needs a writable /dev/shm with open-file-description "
                           "locks on this host; set generator.vllm.handoff=auto (a file where there is none)")
    return choice is EngineHandoff.SHM or (choice is EngineHandoff.AUTO and available())


def worker_joins(cfg: Config) -> bool:
    """Whether an engine out of this process takes the collective route's rounds in its worker
    (`generator.vllm.collective_in_engine`): full-weight pushes (LoRA adapters are folded or registered in the
    generator's process first), one worker (each member of a weight group is one rank), and a weight group
    offered (`generator.collective`, never beside TLS)."""
    g = cfg.generator
    return (g.vllm.collective_in_engine and g.collective and not cfg.run.grpc_tls.serves_tls
            and g.tensor_parallel_size == 1 and not cfg.learner.lora.enabled)

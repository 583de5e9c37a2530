"""What every engine hop is: the `EngineHop` protocol, the kinds there are (`HopKind`), and `land`, the one
call into the engine's workers that every hop ends in.

A hop is the generator -> inference engine step of a push: the receiver has verified a version in the
generator's process (or, for the worker round, the engine's worker received it), and the hop makes every
worker of the vLLM engine load it, full weights or an unmerged LoRA adapter alike. Each hop has two halves:
the generator's (`EngineHop.load`, which says where the tensors lie) and the worker's (`worker.WorkerEnd`,
which reads them back, verified, before any is loaded). A hop that fails raises: the workers loaded nothing
and the engine serves the version before.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from enum import StrEnum
from typing import Any, Protocol

import torch

from asyncrlhf.weights.collective_member import Member

# the vLLM worker extension's methods a hop calls (`asyncrlhf.sampling.vllm_engine.WeightLoaderExtension`)
LOAD, ADD_LORA = "asyncrlhf_load", "asyncrlhf_add_lora"


class HopKind(StrEnum):
    """How a version's bytes reach the engine's workers (the worker reads them back by this name)."""

    IN_PROCESS = "in_process"  # the engine's one worker runs in the generator's process: the tensors
    SHM = "shm"  # the generator's shared-memory segment, rewritten per version
    FILE = "file"  # a safetensors file per version in the generator's work directory
    WORKER_ROUND = "worker_round"  # the collective route's round, received by the worker itself


@dataclass(frozen=True)
class Adapter:
    """An unmerged LoRA adapter's place in the workers: the id it is registered under (in place of the last)
    and its PEFT configuration (plain values: it crosses the RPC)."""

    lora_id: int
    peft: dict[str, Any] = field(hash=False)


class EngineHop(Protocol):
    """The generator -> engine step of a push (see the module)."""

    kind: HopKind

    @property
    def rounds(self) -> Member | None:
        """The collective route's member when the engine's worker receives the rounds itself (the learner's
        broadcast lands there, never in the generator's process); None: a round, if any, is received by the
        generator's process and handed over like any version."""

    def load(self, llm: Any, tensors: Mapping[str, torch.Tensor], adapter: Adapter | None = None) -> None:
        """Have every worker of `llm` (a `vllm.LLM`) load `tensors` (HF names): as its weights, or as the
        LoRA adapter `adapter` (saved-adapter names). Raises when any worker refuses them; then none loaded
        them."""

    def close(self) -> None:
        """Release what the hop holds (a segment, a line to the worker); the engine is stopped or stopping."""


def land(llm: Any, kind: HopKind, message: Any, adapter: Adapter | None) -> None:
    """Ask every worker to read `message` back through the worker half of `kind` and load what it holds."""
    if adapter is None:
        llm.collective_rpc(LOAD, args=(kind.value, message))
    else:
        llm.collective_rpc(ADD_LORA, args=(kind.value, message, adapter.lora_id, adapter.peft))

"""The engine the vLLM tests share (started once per module, eager, fp32, on vLLM's CPU build here), the HF
reference they compare it with, a watch on the files a push writes, and a handoff whose bytes change after
it hashed them."""

from __future__ import annotations

import os
import threading
from collections.abc import Sequence

import torch
from watchdog.events import FileSystemEvent, FileSystemEventHandler

from asyncrlhf.config import Config, SamplingConfig, load_config
from asyncrlhf.sampling import TokenScore
from asyncrlhf.sampling.hf import HFBackend, sampling_log_softmax
from asyncrlhf.sampling.hops.shared_memory import Handoff
from asyncrlhf.weights.shm import SEGMENT_NAME

# The tiny model with head size 32 (64 / 2), one vLLM's CPU attention supports; fp32 like the learner.
OVERRIDES = ["model.tiny.heads=2", "model.dtype=float32", "generator.backend=vllm", "generator.device=cpu",
             "generator.vllm.kv_cache_gib=1", "generator.vllm.max_model_len=256"]
PARITY_ATOL = 1e-3  # nats per token


def vllm_config(cache_dir, *extra: str) -> Config:
    return load_config(["configs/tiny.yaml"], [f"model.cache_dir={cache_dir}", *OVERRIDES, *extra])


def hf_backend(cfg: Config, tokenizer) -> HFBackend:
    """The HF backend of the same config: the weights (and LoRA wrapping) the vLLM engine starts with."""
    return HFBackend.from_config(cfg.model_copy(update={"generator": cfg.generator.model_copy(
        update={"backend": "hf"})}), tokenizer)


@torch.no_grad()
def reference_logprobs(model: torch.nn.Module, prompt: Sequence[int], completion: Sequence[int],
                       sampling: SamplingConfig) -> torch.Tensor:
    """Behaviour log-probs of `completion` under the HF `model` (the definition both backends share)."""
    full = torch.tensor([list(prompt) + list(completion)])
    logits = model(input_ids=full).logits[0, len(prompt) - 1:-1]
    return sampling_log_softmax(logits, sampling).gather(-1, torch.tensor(list(completion))[:, None])[:, 0]


def max_gap(model, prompts, groups, sampling) -> float:
    """Largest per-token |vLLM - HF| behaviour log-prob over every completion of every prompt."""
    gaps = [0.0]
    for prompt, group in zip(prompts, groups, strict=True):
        for c in group:
            expected = reference_logprobs(model, prompt, c.token_ids, sampling)
            gaps.append((torch.tensor(c.logprobs) - expected).abs().max().item())
    return max(gaps)


def score_gap(ours: list[list[TokenScore]], theirs: list[list[TokenScore]]) -> float:
    """Largest per-token gap between two backends' `score_tokens` answers for the same sequences: over each
    token's log-prob and each top-n alternative's (an alternative that only one side lists must be a tie at
    the edge of the other's top n: within the gap of its last entry)."""
    gaps = [0.0]
    for seq_a, seq_b in zip(ours, theirs, strict=True):
        for (lp_a, top_a), (lp_b, top_b) in zip(seq_a, seq_b, strict=True):
            assert len(top_a) == len(top_b)
            gaps.append(abs(lp_a - lp_b))
            b = dict(top_b)
            gaps += [abs(lp - b.get(i, top_b[-1][1])) for i, lp in top_a]
    return max(gaps)


class Writes(FileSystemEventHandler):
    """Every file created, written, moved or deleted under the watched directories."""

    def __init__(self) -> None:
        self.events: list[str] = []
        self._lock = threading.Lock()

    def on_any_event(self, event: FileSystemEvent) -> None:
        # /dev/shm/sem.*: POSIX semaphores (multiprocessing's locks, any process on the host), not weights;
        # a WeightSync segment named by another process id: another run's on this host (every segment of a
        # test's pushes, the learner's and the handoff's, is made by the test's process)
        name = os.path.basename(event.src_path)
        segment = SEGMENT_NAME.match(name)
        foreign = segment is not None and int(segment.group(1)) != os.getpid()
        if event.event_type in ("created", "modified", "moved", "deleted", "closed") and \
                not event.is_directory and not name.startswith("sem.") and not foreign:
            with self._lock:
                self.events.append(f"{event.event_type} {event.src_path}")

    def take(self) -> list[str]:
        with self._lock:
            events, self.events = self.events, []
        return events



class Corrupting(Handoff):
    """A handoff whose segment changes after it was written and hashed (what a stray writer would do)."""

    def write(self, tensors):
        manifest = super().write(tensors)
        _, _, _, offset, _, _ = manifest["tensors"][0]
        self.segment.map[offset] ^= 0xFF
        return manifest

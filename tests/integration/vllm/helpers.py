"""The engine the vLLM tests share (started once per module, eager, fp32, on vLLM's CPU build here), the HF
reference they compare it with, a watch on the files a push writes, and a handoff whose bytes change after
it hashed them."""

from __future__ import annotations

import os
import threading
from collections.abc import Sequence
from pathlib import Path

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


def _our_processes() -> set[int]:
    """This process and its descendants (the engine process a test starts, and that one's children)."""
    children: dict[int, list[int]] = {}
    for entry in os.scandir("/proc"):
        if entry.name.isdigit():
            try:
                ppid = int(Path(entry.path, "stat").read_text().rsplit(")", 1)[1].split()[1])
            except (OSError, IndexError, ValueError):
                continue  # gone while we looked
            children.setdefault(ppid, []).append(int(entry.name))
    ours, todo = set(), [os.getpid()]
    while todo:
        pid = todo.pop()
        ours.add(pid)
        todo += children.get(pid, [])
    return ours


def holders(path: str) -> set[int]:
    """The processes that have `path` open or mapped."""
    found = set()
    for entry in os.scandir("/proc"):
        if not entry.name.isdigit():
            continue
        try:
            if any(os.readlink(fd.path) == path for fd in os.scandir(Path(entry.path, "fd"))) or \
                    path in Path(entry.path, "maps").read_text():
                found.add(int(entry.name))
        except OSError:
            continue  # gone, or not ours to read
    return found


class Writes(FileSystemEventHandler):
    """Every file created, written, moved or deleted under the watched directories, by this process or its
    descendants."""

    def __init__(self) -> None:
        self.events: list[str] = []
        self._lock = threading.Lock()
        self._foreign: dict[str, bool] = {}

    def foreign(self, path: str) -> bool:
        """Whether `path` (under /dev/shm) belongs to another process on the host: a WeightSync segment named
        by another process id, or a file that only processes outside this one's tree hold (another test's
        vLLM engine makes its own psm_* segments). Decided at the first event for the path, while its maker
        holds it; a file nobody holds any more counts as ours."""
        name = os.path.basename(path)
        if name.startswith("sem."):
            return True  # POSIX semaphores (multiprocessing's locks, any process on the host), not weights
        segment = SEGMENT_NAME.match(name)
        if segment is not None:  # every segment of a test's pushes is made by the test's process
            return int(segment.group(1)) != os.getpid()
        if path not in self._foreign:
            held = holders(path)
            self._foreign[path] = bool(held) and not held & _our_processes()
        return self._foreign[path]

    def on_any_event(self, event: FileSystemEvent) -> None:
        path = os.fsdecode(event.src_path)
        if event.event_type in ("created", "modified", "moved", "deleted", "closed") and \
                not event.is_directory and not (path.startswith("/dev/shm/") and self.foreign(path)):
            with self._lock:
                self.events.append(f"{event.event_type} {path}")

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

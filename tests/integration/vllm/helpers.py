"""The engine the vLLM tests share (started once per module, eager, fp32, on vLLM's CPU build here), the HF
reference they compare it with, a watch on the files a push writes, and a handoff whose bytes change after
it hashed them."""

from __future__ import annotations

import os
import threading
import uuid
from collections.abc import Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path

import torch
from watchdog.events import FileSystemEvent, FileSystemEventHandler

from asyncrlhf.config import Config, SamplingConfig, load_config
from asyncrlhf.sampling import TokenScore
from asyncrlhf.sampling.hf import HFBackend, sampling_log_softmax
from asyncrlhf.sampling.hops.shared_memory import Handoff
from asyncrlhf.weights.shm import SEGMENT_NAME, SHM_DIR

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
    """The processes that have `path` open (else, when none has, those that have it mapped)."""
    def scan(holds) -> set[int]:
        found = set()
        for entry in os.scandir("/proc"):
            try:
                if entry.name.isdigit() and holds(entry.path):
                    found.add(int(entry.name))
            except OSError:
                continue  # gone, or not ours to read
        return found

    encoded = os.fsencode(path)
    return scan(lambda proc: any(os.readlink(fd.path) == path for fd in os.scandir(Path(proc, "fd")))) or \
        scan(lambda proc: encoded in Path(proc, "maps").read_bytes())


def foreign(path: str) -> bool:
    """Whether only processes outside this one's tree hold `path` (another test's vLLM engine makes its own
    psm_* segments); a file nobody holds any more counts as ours."""
    held = holders(path)
    return bool(held) and not held & _our_processes()


# What a write shows as. Not "closed": a process that opens an existing file to read or map it and closes it
# writes nothing (vLLM's processes attach to each other's psm_* segments so), and a write shows as
# "modified" or "created" anyway. CI saw another test's engine close its segment in a watch, then exit
# before the segment was judged, so no holder was left to show it was another's.
WRITES = ("created", "modified", "moved", "deleted")
SETTLE = ".watch-settled-"  # the marker files of `Writes.settle`


class Writes(FileSystemEventHandler):
    """Every file created, written, moved or deleted under the watched directories, by this process or its
    descendants. On /dev/shm a WeightSync segment named by another process id is another's; a file of
    another name is judged at its first event, while its maker holds it (`foreign`), on a thread of its own:
    the judging reads /proc, and the observer must go on taking events meanwhile (it drops those still
    queued when it stops)."""

    def __init__(self) -> None:
        self.events: list[tuple[str, Future[bool] | None]] = []
        self._lock = threading.Lock()
        self._verdicts: dict[str, Future[bool]] = {}
        self._judge = ThreadPoolExecutor(max_workers=1, thread_name_prefix="writes-judge")
        self._marker, self._settled = "", threading.Event()
        for name in os.listdir(SHM_DIR):  # judged now, while their makers hold them: their first event may
            if not name.startswith("sem.") and SEGMENT_NAME.match(name) is None:  # be their removal
                path = str(SHM_DIR / name)
                self._verdicts[path] = self._judge.submit(foreign, path)

    def settle(self, directory: Path, timeout: float = 60) -> None:
        """Wait until the observer has taken every event that came before now (a marker file made in the
        watched `directory` arrives after them): an observer stopped at once drops what it has not read."""
        marker = directory / f"{SETTLE}{uuid.uuid4().hex}"
        self._settled.clear()
        self._marker = str(marker)
        marker.touch()
        marker.unlink()
        if not self._settled.wait(timeout):
            raise TimeoutError(f"no event for {marker} within {timeout} s: is {directory} watched?")

    def on_any_event(self, event: FileSystemEvent) -> None:
        if event.event_type not in WRITES or event.is_directory:
            return
        path = os.fsdecode(event.src_path)
        if os.path.basename(path).startswith(SETTLE):
            if path == self._marker:
                self._settled.set()
            return
        verdict = None
        if path.startswith(f"{SHM_DIR}/"):
            name = os.path.basename(path)
            segment = SEGMENT_NAME.match(name)
            if name.startswith("sem."):
                return  # POSIX semaphores (multiprocessing's locks, any process on the host), not weights
            if segment is not None and int(segment.group(1)) != os.getpid():
                return  # every segment of a test's pushes is made by the test's process
            if segment is None:
                with self._lock:
                    if path not in self._verdicts:
                        self._verdicts[path] = self._judge.submit(foreign, path)
                    verdict = self._verdicts[path]
        with self._lock:
            self.events.append((f"{event.event_type} {path}", verdict))

    def take(self) -> list[str]:
        with self._lock:
            events, self.events = self.events, []
        return [event for event, verdict in events if verdict is None or not verdict.result()]


class Corrupting(Handoff):
    """A handoff whose segment changes after it was written and hashed (what a stray writer would do)."""

    def write(self, tensors):
        manifest = super().write(tensors)
        _, _, _, offset, _, _ = manifest["tensors"][0]
        self.segment.map[offset] ^= 0xFF
        return manifest

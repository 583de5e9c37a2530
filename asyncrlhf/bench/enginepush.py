"""`asyncrlhf bench generator --push --config C.yaml [--repeats R] [--json] [overrides]`

Step-to-serve of full-weight pushes into a vLLM engine that runs in processes of its own (the GPU default,
`generator.vllm.engine_in_process=false`), through the generator's shared-memory handoff against through a
safetensors file per version (`generator.vllm.handoff`), and over the collective route received by the
engine's worker itself (`generator.vllm.collective_in_engine`: gloo here, the learner's broadcast straight
into the worker, never through the generator's process), on one engine and one model, in one run. A push is
timed from the learner's weights of a finished step to the engine serving them: for the first two the
pusher's cast and write (the learner's shared-memory route: same host), the receiver's check, the handoff and
the workers' reload; for the collective route the cast, the broadcast, the worker's checks and its reload.
The three alternate push by push (`--repeats` of each after one of each that allocates), each a different
version of the config's model (LoRA off: full weights, in `learner.push_dtype`), so drift on a shared host
hits all alike; medians are reported. Target: shared memory <= 0.5x the file.

Both include the workers' reload (vLLM's in-place `reload_weights`: on CPU it rebuilds each layer and
repacks its weights for oneDNN), which neither path changes; so the bench also times the hop itself, in this
process and without the engine: the handoff's write and its reader's check against `save_file` + `load_file`
(every page read) of the same version.
"""

from __future__ import annotations

import os
import statistics
import time
from pathlib import Path
from typing import Any

import torch
import xxhash

from asyncrlhf.config import Config, EngineHandoff
from asyncrlhf.models import load_policy, load_tokenizer
from asyncrlhf.sampling.hops.file import File
from asyncrlhf.sampling.hops.hop import EngineHop
from asyncrlhf.sampling.hops.shared_memory import Handoff, SharedMemory, read
from asyncrlhf.sampling.hops.worker_round import WorkerRound
from asyncrlhf.version import PolicyVersion
from asyncrlhf.weights.access import ClientAccess, ServerAccess
from asyncrlhf.weights.codec import PUSH_DTYPES
from asyncrlhf.weights.collective_sender import CollectiveSender
from asyncrlhf.weights.pusher import PushTarget, WeightPusher
from asyncrlhf.weights.receiver import WeightReceiver
from asyncrlhf.weights.server import serve
from asyncrlhf.weights.shm_read import SegmentMaps

TARGET_RATIO = 0.5
TOKEN = "bench"


def engine_config(cfg: Config) -> Config:
    """The config's model and generator, full weights, the engine in processes of its own."""
    g = cfg.generator
    vllm = g.vllm.model_copy(update={"engine_in_process": False, "handoff": EngineHandoff.SHM,
                                     "collective_in_engine": True})
    learner = cfg.learner.model_copy(update={"lora": cfg.learner.lora.model_copy(update={"enabled": False})})
    generator = g.model_copy(update={"backend": "vllm", "vllm": vllm, "collective": True})
    return cfg.model_copy(update={"generator": generator, "learner": learner})


def _timed_push(pusher: WeightPusher, weights: dict[str, torch.Tensor], step: int, target: PushTarget,
                ) -> float:
    start = time.perf_counter()
    (outcome,) = pusher.push(weights, PolicyVersion(0, step), [target])
    seconds = time.perf_counter() - start
    if outcome.status != "ok":
        raise RuntimeError(f"bench push of version {step} failed: {outcome}")
    return seconds


def compare(cfg: Config, repeats: int, engine: Any = None) -> dict[str, Any]:
    """Time every path into `engine` (a `VLLMBackend` out of process, left running), else into one started
    from `cfg` (and stopped)."""
    from asyncrlhf.sampling.vllm import VLLMBackend

    cfg = engine_config(cfg)
    backend = engine or VLLMBackend.from_config(cfg, load_tokenizer(cfg.model))
    joined = backend.hop
    if not isinstance(joined, WorkerRound) or not isinstance(joined.handed, SharedMemory):
        raise RuntimeError("the engine runs in this process, has no shared-memory handoff, or its worker "
                           "cannot join a weight group (run.grpc_tls set?)")
    state = {name: t.detach() for name, t in load_policy(cfg.model).state_dict().items()}
    nbytes = sum(t.numel() for t in state.values()) * PUSH_DTYPES[cfg.learner.push_dtype].itemsize
    times: dict[str, list[float]] = {"shm": [], "file": [], "collective": []}
    receiver = WeightReceiver(backend, collective=joined.member)
    server, port = serve(receiver, access=ServerAccess(TOKEN))
    access, timeout_s = ClientAccess(TOKEN), 600
    collective = CollectiveSender(cfg.learner.collective_host, cfg.learner.collective_bucket_bytes, timeout_s,
                                  access=access)
    by_file = File(backend.work_dir)
    try:
        target = PushTarget("bench", f"127.0.0.1:{port}")
        with WeightPusher(access, dtype=cfg.learner.push_dtype, timeout_s=timeout_s) as pusher, \
                WeightPusher(access, dtype=cfg.learner.push_dtype, timeout_s=timeout_s,
                             route_senders=[collective]) as broadcaster:
            step = backend.version  # versions go forward from what the engine serves
            for r in range(repeats + 1):
                # the worker round hands over the versions that reach this process by shared memory
                order: list[tuple[str, EngineHop, WeightPusher]] = [
                    ("shm", joined, pusher), ("file", by_file, pusher), ("collective", joined, broadcaster)]
                for mode, hop, by in order[r % 3:] + order[:r % 3]:
                    backend.hop = hop
                    step += 1
                    weights = {name: t + step * 1e-3 if t.is_floating_point() else t
                               for name, t in state.items()}
                    times[mode].append(_timed_push(by, weights, step, target))
    finally:
        backend.hop = joined
        server.stop(0)
        if engine is None:
            backend.close()
    shm_s, file_s = statistics.median(times["shm"][1:]), statistics.median(times["file"][1:])
    collective_s = statistics.median(times["collective"][1:])
    wire = {name: (t.to(PUSH_DTYPES[cfg.learner.push_dtype]) if t.is_floating_point() else t).clone()
            for name, t in state.items()}  # tied weights apart, as a receiver stages them
    hop_shm, hop_file = hop_seconds(wire, repeats, backend.work_dir.parent)
    return {"model": cfg.model.name_or_path, "push_dtype": cfg.learner.push_dtype, "push_bytes": nbytes,
            "repeats": repeats, "shm_step_to_serve_s": shm_s, "file_step_to_serve_s": file_s,
            "ratio": shm_s / file_s, "target_ratio": TARGET_RATIO, "collective_step_to_serve_s": collective_s,
            "collective_ratio": collective_s / file_s, "shm_hop_s": hop_shm,
            "file_hop_s": hop_file, "hop_ratio": hop_shm / hop_file, "times": times}


def hop_seconds(tensors: dict[str, torch.Tensor], repeats: int, directory: Path) -> tuple[float, float]:
    """Median seconds of the hop alone (no engine), alternating: the handoff written and read back
    (checked), and a safetensors file saved, loaded and every page read (what the workers' reload reads)."""
    from safetensors.torch import load_file, save_file

    writer, maps = Handoff(), SegmentMaps()
    path = directory / f"bench-hop-{os.getpid()}.safetensors"
    shm_s, file_s = [], []
    try:
        for _ in range(repeats + 1):
            start = time.perf_counter()
            read(writer.write(tensors), maps)
            shm_s.append(time.perf_counter() - start)
            start = time.perf_counter()
            save_file(tensors, str(path))
            loaded = load_file(str(path))
            for t in loaded.values():
                xxhash.xxh3_64_intdigest(t.reshape(-1).view(torch.uint8).numpy())  # type: ignore[arg-type]
            path.unlink()
            file_s.append(time.perf_counter() - start)
    finally:
        writer.close()
        path.unlink(missing_ok=True)
    return statistics.median(shm_s[1:]), statistics.median(file_s[1:])


def report(result: dict[str, Any]) -> list[str]:
    verdict = "ok" if result["ratio"] <= TARGET_RATIO else f"> {TARGET_RATIO}"
    return [f"vLLM engine out of process, model {result['model']}, {result['push_bytes'] / 1e6:.0f} MB per "
            f"version ({result['push_dtype']}), median of {result['repeats']} pushes each",
            f"  step-to-serve  shared memory {result['shm_step_to_serve_s']:.3f} s   file "
            f"{result['file_step_to_serve_s']:.3f} s   ratio {result['ratio']:.2f}x (target <= "
            f"{TARGET_RATIO}: {verdict})",
            f"  step-to-serve  collective, received by the engine's worker "
            f"{result['collective_step_to_serve_s']:.3f} s   ratio to the file "
            f"{result['collective_ratio']:.2f}x",
            f"  the hop alone  shared memory {result['shm_hop_s']:.3f} s   file "
            f"{result['file_hop_s']:.3f} s   ratio {result['hop_ratio']:.2f}x (no engine)"]

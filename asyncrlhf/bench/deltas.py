"""`asyncrlhf bench generator --delta --config C.yaml [--repeats R] [--json] [overrides]`

Delta pushes on the wire with full fine-tuning: the config's model (LoRA off) trained `--repeats` steps of
AdamW at `learner.lr` (fp32 master weights, the causal-LM loss on the config's training prompts: a dense
gradient, as RL's is), each version pushed in `learner.push_dtype` to two generator processes (WeightSync
servers over receivers holding the model's tensors, each with a data channel, as across hosts), one by a
pusher with delta pushes (`learner.push_delta`), the other by one without, alternating which goes first.
Per step: the share of elements whose pushed bits changed, the tensor bytes each push put on the wire (the
receiver's count), the seconds of each push (the delta's includes encoding it against the learner's base,
and the receiver's apply and check), and the seconds of the encoding alone.
Target: delta bytes <= 0.2x a full push, or the changed share that makes it impossible.
"""

from __future__ import annotations

import math
import statistics
import time
from collections.abc import Mapping
from typing import Any

import torch

from asyncrlhf.bench.modes import task_prompts
from asyncrlhf.bench.weightplane import Tensors, receiver_processes
from asyncrlhf.config import Config
from asyncrlhf.models import load_policy, load_tokenizer
from asyncrlhf.version import PolicyVersion
from asyncrlhf.weights.access import ClientAccess, ServerAccess
from asyncrlhf.weights.channel_read import DataListener
from asyncrlhf.weights.codec import PUSH_DTYPES
from asyncrlhf.weights.pusher import Encoding, PushOutcome, PushStatus, PushTarget, WeightPusher
from asyncrlhf.weights.receiver import WeightReceiver
from asyncrlhf.weights.server import serve
from asyncrlhf.weights.vocabulary import Route

TARGET_RATIO = 0.2
TOKEN = "bench"


def pushed(model: torch.nn.Module, dtype: torch.dtype) -> dict[str, torch.Tensor]:
    return {name: t.detach().to(dtype).contiguous() for name, t in model.state_dict().items()}


def _generator(shapes: Mapping[str, tuple[tuple[int, ...], torch.dtype]], conn) -> None:
    """A light generator: a WeightSync server with a data channel over a receiver holding tensors of
    `shapes` (in the push dtype, as an engine serving it), until the parent says stop."""
    torch.set_num_threads(1)
    data = DataListener()
    receiver = WeightReceiver(Tensors({k: torch.zeros(s, dtype=d) for k, (s, d) in shapes.items()}),
                              data=data)
    server, port = serve(receiver, access=ServerAccess(TOKEN))
    conn.send(port)
    conn.recv()
    server.stop(0).wait(10)  # exiting while gRPC still shuts down can abort the process
    data.close()


def generators(shapes: Mapping[str, tuple[tuple[int, ...], torch.dtype]], n: int):
    """`n` generator processes; yields their addresses."""
    return receiver_processes(_generator, dict(shapes), n)


def _push(pusher: WeightPusher, weights: dict[str, torch.Tensor], step: int, address: str,
          ) -> tuple[PushOutcome, float]:
    start = time.perf_counter()
    (outcome,) = pusher.push(weights, PolicyVersion(0, step), [PushTarget("bench", address)])
    elapsed = time.perf_counter() - start
    if outcome.status != PushStatus.OK:
        raise RuntimeError(f"bench push failed: {outcome}")
    return outcome, elapsed


def _changed(pusher: WeightPusher, weights: dict[str, torch.Tensor], step: int, address: str,
             ) -> tuple[float, float]:
    """The share of elements the version's delta names (a tensor sent whole counts whole) and the seconds
    to encode it (once per version: the push that follows reuses it)."""
    assert pusher.deltas is not None
    start = time.perf_counter()
    version = pusher.deltas.version(pusher.prepare(weights, PolicyVersion(0, step)), [address])
    elapsed = time.perf_counter() - start
    sent = version.delta.tensors if version.delta is not None else version.full.tensors
    changed = sum(t.delta.elements if t.delta is not None else math.prod(t.shape) for t in sent)
    return changed / sum(math.prod(t.shape) for t in sent), elapsed


def _step(model: torch.nn.Module, optimizer: torch.optim.Optimizer, prompts: list[list[int]]) -> None:
    loss = torch.stack([model(input_ids=torch.tensor([p]), labels=torch.tensor([p])).loss
                        for p in prompts]).mean()
    optimizer.zero_grad()
    loss.backward()
    optimizer.step()


def measure(cfg: Config, steps: int) -> dict[str, Any]:
    tokenizer = load_tokenizer(cfg.model)
    model = load_policy(cfg.model.model_copy(update={"dtype": "float32"})).train()
    batch = [p for p in task_prompts(cfg, tokenizer, 4 * cfg.generator.batch_prompts) if len(p) > 1]
    optimizer = torch.optim.AdamW(model.parameters(), lr=cfg.learner.lr)
    dtype = PUSH_DTYPES[cfg.learner.push_dtype]
    weights = pushed(model, dtype)
    shapes = {k: (tuple(v.shape), v.dtype) for k, v in weights.items()}
    access = ClientAccess(TOKEN)
    per_step: list[dict[str, Any]] = []
    kw: dict[str, Any] = {"chunk_bytes": cfg.learner.push_chunk_bytes, "dtype": cfg.learner.push_dtype,
                          "timeout_s": 600, "routes": (Route.DATA, Route.STREAM)}
    with generators(shapes, 2) as (delta_at, full_at), WeightPusher(access, delta=True, **kw) as by_delta, \
            WeightPusher(access, **kw) as by_full:
        for by, address in ((by_delta, delta_at), (by_full, full_at)):  # version 1: whole to both
            _push(by, weights, 1, address)
        for step in range(steps):
            _step(model, optimizer, batch[step % len(batch)::steps] or batch)
            weights, version = pushed(model, dtype), step + 2
            changed, encode_s = _changed(by_delta, weights, version, delta_at)
            order = [(by_delta, delta_at), (by_full, full_at)][::1 if step % 2 == 0 else -1]
            timed = {by is by_delta: _push(by, weights, version, address) for by, address in order}
            (delta, delta_s), (full, full_s) = timed[True], timed[False]
            if delta.encoding != Encoding.DELTA or full.encoding != Encoding.FULL:
                raise RuntimeError(f"bench: expected a delta and a full push, got {delta}, {full}")
            per_step.append({"changed_fraction": changed, "delta_bytes": delta.bytes,
                             "full_bytes": full.bytes, "ratio": delta.bytes / full.bytes,
                             "encode_s": encode_s, "delta_push_s": encode_s + delta_s, "full_push_s": full_s,
                             "push_time_ratio": (encode_s + delta_s) / full_s,
                             "route": delta.route.value if delta.route else ""})
    return {"model": cfg.model.name_or_path, "lr": cfg.learner.lr, "push_dtype": cfg.learner.push_dtype,
            "steps": steps, "changed_fraction": statistics.median(s["changed_fraction"] for s in per_step),
            "ratio": statistics.median(s["ratio"] for s in per_step),
            "push_time_ratio": statistics.median(s["push_time_ratio"] for s in per_step),
            "target_ratio": TARGET_RATIO, "per_step": per_step}


def report(result: dict[str, Any]) -> list[str]:
    route = result["per_step"][0]["route"] if result["per_step"] else ""
    lines = [f"delta pushes on the wire, full fine-tuning: model {result['model']}, AdamW lr "
             f"{result['lr']:g}, {result['push_dtype']} pushes over {route}, {result['steps']} steps"]
    for i, s in enumerate(result["per_step"], 1):
        lines.append(f"  step {i}: changed {s['changed_fraction']:.2%}   on the wire: delta "
                     f"{s['delta_bytes'] / 1e6:.1f} MB, full {s['full_bytes'] / 1e6:.1f} MB "
                     f"({s['ratio']:.3f}x)   push: delta {s['delta_push_s']:.2f} s (encode "
                     f"{s['encode_s']:.2f} s), full {s['full_push_s']:.2f} s ({s['push_time_ratio']:.2f}x)")
    verdict = "ok" if result["ratio"] <= TARGET_RATIO else f"> {TARGET_RATIO}"
    lines.append(f"  median: changed {result['changed_fraction']:.2%}, bytes per version delta / full "
                 f"{result['ratio']:.3f}x (target <= {TARGET_RATIO}: {verdict}), push time delta / full "
                 f"{result['push_time_ratio']:.2f}x")
    return lines

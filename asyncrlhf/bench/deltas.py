"""`asyncrlhf bench generator --delta --config C.yaml [--repeats R] [--json] [overrides]`

What delta pushes would send with full fine-tuning: the config's model (LoRA off) trained `--repeats` steps
of AdamW at `learner.lr` (fp32 master weights, the causal-LM loss on the config's training prompts: a dense
gradient, as RL's is), each version cast to `learner.push_dtype` and encoded against the one before it
(`weights.delta`, a tensor sent whole where its delta would not be smaller). Per step: the share of elements
whose pushed bits changed, the bytes of the delta against the bytes of a full push, the seconds to encode it
(learner) and to apply it to the base and hash the result (generator: what verifying a delta costs).
Target: delta bytes <= 0.2x a full push, or the changed share that makes it impossible.
"""

from __future__ import annotations

import statistics
import time
from typing import Any

import torch
import xxhash

from asyncrlhf.bench.modes import task_prompts
from asyncrlhf.config import Config
from asyncrlhf.models import load_policy, load_tokenizer
from asyncrlhf.weights import delta
from asyncrlhf.weights.codec import PUSH_DTYPES

TARGET_RATIO = 0.2


def pushed(model: torch.nn.Module, dtype: torch.dtype) -> dict[str, torch.Tensor]:
    return {name: t.detach().to(dtype).contiguous() for name, t in model.state_dict().items()}


def encode_version(base: dict[str, torch.Tensor], new: dict[str, torch.Tensor]) -> dict[str, Any]:
    """One version's delta against `base`: changed elements, bytes sent, seconds to encode and to apply."""
    changed = elements = sent = full = 0
    encode_s = apply_s = 0.0
    for name, t in new.items():
        start = time.perf_counter()
        d = delta.encode(base[name], t)
        encode_s += time.perf_counter() - start
        elements += t.numel()
        full += delta.full_bytes(t)
        changed += d.indices.numel() if d is not None else t.numel()
        if d is None or not delta.worth_sending(d, t):
            sent += delta.full_bytes(t)
            continue
        sent += d.nbytes
        start = time.perf_counter()
        result = delta.apply(base[name], d)
        xxhash.xxh3_64_intdigest(result.reshape(-1).view(torch.uint8).numpy())  # type: ignore[arg-type]
        apply_s += time.perf_counter() - start
    return {"changed_fraction": changed / elements, "delta_bytes": sent, "full_bytes": full,
            "ratio": sent / full, "encode_s": encode_s, "apply_and_hash_s": apply_s}


def measure(cfg: Config, steps: int) -> dict[str, Any]:
    tokenizer = load_tokenizer(cfg.model)
    model = load_policy(cfg.model.model_copy(update={"dtype": "float32"})).train()
    batch = [p for p in task_prompts(cfg, tokenizer, 4 * cfg.generator.batch_prompts) if len(p) > 1]
    optimizer = torch.optim.AdamW(model.parameters(), lr=cfg.learner.lr)
    dtype = PUSH_DTYPES[cfg.learner.push_dtype]
    base = pushed(model, dtype)
    per_step = []
    for step in range(steps):
        prompts = batch[step % len(batch)::steps] or batch
        loss = torch.stack([model(input_ids=torch.tensor([p]), labels=torch.tensor([p])).loss
                            for p in prompts]).mean()
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        new = pushed(model, dtype)
        per_step.append(encode_version(base, new))
        base = new
    return {"model": cfg.model.name_or_path, "lr": cfg.learner.lr, "push_dtype": cfg.learner.push_dtype,
            "steps": steps, "changed_fraction": statistics.median(s["changed_fraction"] for s in per_step),
            "ratio": statistics.median(s["ratio"] for s in per_step), "target_ratio": TARGET_RATIO,
            "per_step": per_step}


def report(result: dict[str, Any]) -> list[str]:
    lines = [f"delta pushes, full fine-tuning: model {result['model']}, AdamW lr {result['lr']:g}, "
             f"{result['push_dtype']} pushes, {result['steps']} steps"]
    for i, s in enumerate(result["per_step"], 1):
        lines.append(f"  step {i}: changed {s['changed_fraction']:.2%}   delta "
                     f"{s['delta_bytes'] / 1e6:.1f} MB of {s['full_bytes'] / 1e6:.1f} MB "
                     f"({s['ratio']:.3f}x)   "
                     f"encode {s['encode_s']:.2f} s   apply+hash {s['apply_and_hash_s']:.2f} s")
    verdict = "ok" if result["ratio"] <= TARGET_RATIO else f"> {TARGET_RATIO}"
    lines.append(f"  median: changed {result['changed_fraction']:.2%}, delta / full {result['ratio']:.3f}x "
                 f"(target <= {TARGET_RATIO}: {verdict})")
    return lines

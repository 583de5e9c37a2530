"""`asyncrlhf bench generator --modes --config C.yaml [--prompts N] [--repeats R] [--json] [overrides]`

Generator tokens/s, continuous against batch mode, on one vLLM engine and the same prompt groups (the config's
training prompts, the first N), measured in one run. Batch: `backend.generate` on `generator.batch_prompts`
groups at a time, as the batch loop calls it (the next batch starts when the longest sample of this one
ends). Continuous: the `ContinuousSampler` the continuous loop runs, `batch_prompts x samples_per_prompt`
samples in the engine at once, a group started whenever k slots are free. The two alternate pass by pass
(`--repeats`), each from the same torch seed, so drift on a shared host hits both alike.

Also printed: the share of sample slots that held a running sample (batch: the tokens over capacity times
each batch's longest sample; continuous: over capacity times steps), and the completion lengths.
Redis, rewards and training are not in it: the end-to-end figure is `asyncrlhf bench pipeline`.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Sequence
from typing import Any

import torch

from asyncrlhf.config import Config
from asyncrlhf.models import encode_prompts, load_tokenizer
from asyncrlhf.sampling.continuous import ContinuousSampler, GroupPrompt
from asyncrlhf.sampling.single_turn import Completions, Progress
from asyncrlhf.tasks import load_task


def task_prompts(cfg: Config, tokenizer, n: int) -> list[list[int]]:
    """The first `n` training prompts of the config's task, as the learner encodes them."""
    task = load_task(cfg.task)
    return encode_prompts(tokenizer, list(task.train[:n]), cfg.model)


def batch_pass(backend: Any, prompts: list[list[int]], cfg: Config) -> dict:
    g = cfg.generator
    lengths: list[int] = []
    slot_steps = 0
    start = time.perf_counter()
    for i in range(0, len(prompts), g.batch_prompts):
        groups = backend.generate(prompts[i:i + g.batch_prompts], g.samples_per_prompt, g.sampling)
        batch = [len(c.token_ids) for group in groups for c in group]
        lengths += batch
        slot_steps += g.batch_prompts * g.samples_per_prompt * max(batch)
    seconds = time.perf_counter() - start
    return {"tokens": sum(lengths), "seconds": seconds, "occupancy": sum(lengths) / slot_steps,
            "lengths": lengths}


def continuous_pass(engine: Any, prompts: list[list[int]], cfg: Config) -> dict:
    g = cfg.generator
    capacity = g.max_running_samples or g.batch_prompts * g.samples_per_prompt
    sampler: ContinuousSampler[int, Progress] = ContinuousSampler(engine, Completions(), g.sampling)
    lengths: list[int] = []
    queue = list(enumerate(prompts))
    running_per_step: list[int] = []
    start = time.perf_counter()
    while queue or sampler.running_samples:
        while queue and capacity - sampler.running_samples >= g.samples_per_prompt:
            i, ids = queue.pop(0)
            sampler.start(i, f"p{i}", GroupPrompt(ids), g.samples_per_prompt, lineage=1)
        running_per_step.append(sampler.running_samples)
        for run in sampler.step(1):
            lengths += [len(s.token_ids) for s in run.samples]
    seconds = time.perf_counter() - start
    return {"tokens": sum(lengths), "seconds": seconds,
            "occupancy": sum(running_per_step) / (capacity * len(running_per_step)), "lengths": lengths}


def compare(cfg: Config, n_prompts: int, repeats: int) -> dict:
    from asyncrlhf.sampling.vllm import VLLMBackend
    from asyncrlhf.sampling.vllm_stepping import VLLMStepEngine

    tokenizer = load_tokenizer(cfg.model)
    backend = VLLMBackend.from_config(cfg, tokenizer)
    try:
        prompts = task_prompts(cfg, tokenizer, n_prompts)
        engine = VLLMStepEngine(backend, seed=cfg.run.seed)
        warm = prompts[: cfg.generator.batch_prompts]
        batch_pass(backend, warm, cfg)
        continuous_pass(engine, warm, cfg)
        passes: dict[str, list[dict]] = {"batch": [], "continuous": []}
        for r in range(repeats):
            torch.manual_seed(cfg.run.seed + r)
            passes["batch"].append(batch_pass(backend, prompts, cfg))
            engine = VLLMStepEngine(backend, seed=cfg.run.seed + r)
            passes["continuous"].append(continuous_pass(engine, prompts, cfg))
    finally:
        backend.close()
    return summarise(cfg, len(prompts), passes)


def summarise(cfg: Config, n: int, passes: dict[str, list[dict]]) -> dict:
    def rate(p: dict) -> float:
        return p["tokens"] / p["seconds"]

    g = cfg.generator
    out: dict[str, Any] = {"model": cfg.model.name_or_path, "prompts": n, "k": g.samples_per_prompt,
                           "batch_prompts": g.batch_prompts, "max_new_tokens": g.sampling.max_new_tokens,
                           "repeats": len(passes["batch"])}
    for mode, runs in passes.items():
        lengths = sorted(x for p in runs for x in p["lengths"])
        out[mode] = {"tokens_per_s": sum(p["tokens"] for p in runs) / sum(p["seconds"] for p in runs),
                     "tokens_per_s_each": [round(rate(p), 1) for p in runs],
                     "slot_occupancy": statistics.fmean(p["occupancy"] for p in runs),
                     "length_median": statistics.median(lengths),
                     "length_p25": lengths[len(lengths) // 4], "length_p75": lengths[3 * len(lengths) // 4],
                     "length_max": lengths[-1]}
    out["ratio"] = out["continuous"]["tokens_per_s"] / out["batch"]["tokens_per_s"]
    out["ratio_each"] = [round(rate(c) / rate(b), 3)
                         for b, c in zip(passes["batch"], passes["continuous"], strict=True)]
    return out


def report(result: dict) -> Sequence[str]:
    r = result
    lines = [f"generator modes bench: model {r['model']}, {r['prompts']} prompts x k={r['k']}, batches of "
             f"{r['batch_prompts']}, max_new_tokens={r['max_new_tokens']}, {r['repeats']} passes each"]
    for mode in ("batch", "continuous"):
        m = r[mode]
        lines.append(f"  {mode:10} {m['tokens_per_s']:8.1f} tok/s (passes {m['tokens_per_s_each']}), slots "
                     f"busy {m['slot_occupancy']:.0%}, lengths median {m['length_median']} p25 "
                     f"{m['length_p25']} p75 {m['length_p75']} max {m['length_max']}")
    lines.append(f"  continuous / batch: {r['ratio']:.2f}x tokens/s (per pass: {r['ratio_each']})")
    return lines

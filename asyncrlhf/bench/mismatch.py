"""`asyncrlhf bench mismatch --config C.yaml [--prompts N] [--pairs ENGINE:TRAINER,...] [--json] [overrides]`

The training-inference mismatch of vLLM (the CPU build here) against the HF trainer for the same weights.
vLLM samples `samples_per_prompt` completions of each of the config's first N training prompts and records
each token's behaviour log-prob (log μ: its processed log-probs, the sampling temperature applied); the
learner's own forward (`Padded.logps`, what its frozen pass runs) scores the same tokens (log π). Per
engine:trainer dtype pair, over every completion token: the mean, p99 and max of |log π − log μ|, the k3
estimate of KL(μ ‖ π) and the share of tokens whose ratio π / μ leaves [1/c, c], c being
`learner.rollout_correction_cap` (`asyncrlhf.algorithms.mismatch`, as the learner measures it each step).

`--pairs` defaults to float32:float32, bfloat16:bfloat16 and bfloat16:float32 (a bf16 engine beside an fp32
learner, what `generator.vllm.dtype=bfloat16` gives). One engine per engine dtype, in turn; its samples are
scored by each trainer dtype paired with it. The weights are the model's as both load it (version 0: LoRA
adapters, where the config has them, at their initial no-op). Gold and KL of the demo trained with the
correction off and on: `asyncrlhf bench pipeline --runs async1,tis1 --backend vllm`.
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Sequence
from typing import Any

import torch

from asyncrlhf import algorithms as A
from asyncrlhf._proto.rollout_pb2 import PromptGroup, RolloutGroup, Sample
from asyncrlhf.bench.modes import task_prompts
from asyncrlhf.config import Config, load_config
from asyncrlhf.config_cli import split_config_args
from asyncrlhf.models import load_policy, load_tokenizer
from asyncrlhf.training.batch import TrainGroup, build_batch
from asyncrlhf.training.forward import Padded

DTYPES = ("float32", "bfloat16", "float16")
DEFAULT_PAIRS = "float32:float32,bfloat16:bfloat16,bfloat16:float32"


def parse_pairs(text: str) -> list[tuple[str, str]]:
    """`ENGINE:TRAINER,...` -> [(engine dtype, trainer dtype)], in order; a clear error for anything else."""
    pairs = []
    for item in (p.strip() for p in text.split(",") if p.strip()):
        parts = item.split(":")
        if len(parts) != 2 or not set(parts) <= set(DTYPES):
            raise ValueError(f"--pairs: `{item}` is not ENGINE:TRAINER with each one of {', '.join(DTYPES)} "
                             f"(e.g. {DEFAULT_PAIRS})")
        pairs.append((parts[0], parts[1]))
    if not pairs:
        raise ValueError(f"--pairs: no pair given (e.g. {DEFAULT_PAIRS})")
    return pairs


def sample(cfg: Config, backend: Any, prompts: list[list[int]]) -> list[RolloutGroup]:
    """The engine's completions of `prompts`, `generator.batch_prompts` at a time, with their log-probs."""
    g = cfg.generator
    torch.manual_seed(cfg.run.seed)  # each generate call's vLLM seed is drawn from torch's RNG
    groups = []
    for start in range(0, len(prompts), g.batch_prompts):
        batch = prompts[start : start + g.batch_prompts]
        for i, (ids, completions) in enumerate(zip(batch, backend.generate(batch, g.samples_per_prompt,
                                                                           g.sampling), strict=True)):
            samples = [Sample(completion_token_ids=c.token_ids, logprobs=c.logprobs) for c in completions]
            groups.append(RolloutGroup(group_id=f"g{start + i:08d}", samples=samples,
                                       prompt=PromptGroup(prompt_token_ids=ids, k=len(samples))))
    return groups


@torch.no_grad()
def figures(cfg: Config, groups: list[RolloutGroup], trainer_dtype: str, pad_id: int) -> dict[str, float]:
    """The mismatch of `groups`' recorded log-probs against the HF trainer's in `trainer_dtype`."""
    model_cfg = cfg.model.model_copy(update={"dtype": trainer_dtype})
    model = load_policy(model_cfg, lora=cfg.learner.lora).eval()
    rows = build_batch([TrainGroup(g) for g in groups], pad_id)
    forward = Padded(cfg.learner.micro_batch_size)
    learner = torch.zeros_like(rows.mask)
    for index in forward.frozen_micros(rows):
        learner[index] = forward.logps(model, rows.rows(index), cfg.generator.sampling.temperature)
    real = rows.mask.bool()
    gaps = (learner - rows.behaviour_logps)[real].abs().double()
    totals = A.mismatch_totals(rows.behaviour_logps, learner, real, cfg.learner.rollout_correction_cap)
    return {**totals.stats(), "mismatch_abs_log_ratio_p99": float(torch.quantile(gaps, 0.99))}


def measure(cfg: Config, backend: Any, tokenizer, prompts: list[list[int]],
            trainer_dtypes: Sequence[str]) -> dict[str, dict[str, float]]:
    """One engine's samples of `prompts`, scored by the trainer in each of `trainer_dtypes`."""
    groups = sample(cfg, backend, prompts)
    pad_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else 0
    return {dtype: figures(cfg, groups, dtype, pad_id) for dtype in trainer_dtypes}


def run(cfg: Config, n_prompts: int, pairs: list[tuple[str, str]]) -> dict:
    """Every pair, one engine per engine dtype in turn (closed before the next starts)."""
    from asyncrlhf.sampling.vllm import VLLMBackend

    tokenizer = load_tokenizer(cfg.model)
    prompts = task_prompts(cfg, tokenizer, n_prompts)
    rows = []
    for engine_dtype in dict.fromkeys(e for e, _ in pairs):
        generator = cfg.generator.model_copy(update={
            "backend": "vllm", "vllm": cfg.generator.vllm.model_copy(update={"dtype": engine_dtype})})
        backend = VLLMBackend.from_config(cfg.model_copy(update={"generator": generator}), tokenizer)
        try:
            measured = measure(cfg, backend, tokenizer, prompts, [t for e, t in pairs if e == engine_dtype])
        finally:
            backend.close()
        rows += [{"engine": engine_dtype, "trainer": t, **f} for t, f in measured.items()]
    s = cfg.generator.sampling
    return {"model": cfg.model.name_or_path, "prompts": len(prompts), "k": cfg.generator.samples_per_prompt,
            "temperature": s.temperature, "max_new_tokens": s.max_new_tokens,
            "cap": cfg.learner.rollout_correction_cap, "pairs": rows}


def report(result: dict) -> list[str]:
    r, c = result, result["cap"]
    lines = [f"mismatch bench: model {r['model']}, {r['prompts']} prompts x k={r['k']}, temperature "
             f"{r['temperature']}, max_new_tokens {r['max_new_tokens']}; |log pi - log mu| per token",
             f"  {'engine':<10}{'trainer':<10}{'tokens':>8}{'mean':>10}{'p99':>10}{'max':>10}{'KL k3':>10}"
             f"{f'outside [1/{c:g}, {c:g}]':>20}"]
    for p in r["pairs"]:
        lines.append(f"  {p['engine']:<10}{p['trainer']:<10}{int(p['mismatch_tokens']):>8}"
                     f"{p['mismatch_abs_log_ratio_mean']:>10.2e}{p['mismatch_abs_log_ratio_p99']:>10.2e}"
                     f"{p['mismatch_abs_log_ratio_max']:>10.2e}{p['mismatch_kl']:>10.2e}"
                     f"{p['mismatch_outside_share']:>20.4f}")
    return lines


def main(argv: Sequence[str]) -> int:
    parser = argparse.ArgumentParser(prog="asyncrlhf bench mismatch", description=__doc__.split("\n\n")[1])
    parser.add_argument("--config", action="append", required=True)
    parser.add_argument("--prompts", type=int, default=32, help="the config's first N training prompts")
    parser.add_argument("--pairs", default=DEFAULT_PAIRS, help="ENGINE:TRAINER dtypes, comma-separated")
    parser.add_argument("--json", action="store_true", help="print one JSON object")
    args, rest = parser.parse_known_args(list(argv))
    try:
        pairs = parse_pairs(args.pairs)
    except ValueError as err:
        parser.error(str(err))
    if args.prompts < 1:
        parser.error(f"--prompts must be 1 or more, got {args.prompts}")
    files, overrides = split_config_args([a for f in args.config for a in ("--config", f)] + rest)
    result = run(load_config(files, overrides), args.prompts, pairs)
    print(json.dumps(result) if args.json else "\n".join(report(result)))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))

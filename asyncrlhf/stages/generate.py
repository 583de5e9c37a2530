"""`asyncrlhf generate --config X --checkpoint DIR [DIR ...] [--output F]`: held-out completions of each
checkpoint (the seed's generate-for-eval), with `evaluator.backend` (HF or vLLM) and its decoding
(`evaluator.temperature`, 0 = greedy; `evaluator.max_new_tokens`).

DIR is a learner checkpoint (`<run.dir>/checkpoints/step-XXXXXX`, its `hf/`, or `checkpoints/` for the
latest), any HF model directory, or `initial` for the run's starting model. Writes JSONL (default
`<run.dir>/eval/generations.jsonl`), one row per checkpoint and prompt: checkpoint, version, prompt,
prompt_ids, completion, completion_ids, finish. `asyncrlhf eval` scores it.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Sequence
from pathlib import Path

import torch

from asyncrlhf.config import Config
from asyncrlhf.models import load_policy, load_tokenizer, set_threads
from asyncrlhf.stages.common import run_stage, write_jsonl
from asyncrlhf.stages.evaluation import GoldEvaluation, eval_dir
from asyncrlhf.training.checkpoint import checkpoint_version, load_checkpoint_policy

log = logging.getLogger("asyncrlhf.generate")
INITIAL = "initial"


def load_for_eval(cfg: Config, checkpoint: str, device: str):
    """(policy, version) of a `--checkpoint` argument."""
    if checkpoint == INITIAL:
        return load_policy(cfg.model, device=device), 1
    return load_checkpoint_policy(checkpoint, cfg.model, device=device), checkpoint_version(checkpoint)


def run(cfg: Config, log_: logging.Logger, flags: dict) -> int:
    set_threads(cfg.evaluator.threads)
    torch.manual_seed(cfg.run.seed)
    evaluation = GoldEvaluation(cfg, load_tokenizer(cfg.model))
    device = str(evaluation.sampler.device)
    rows = []
    for checkpoint in flags["--checkpoint"]:
        policy, version = load_for_eval(cfg, checkpoint, device)
        name = checkpoint if checkpoint == INITIAL else str(Path(checkpoint).resolve())
        rows += [
            g.to_row(checkpoint=name, version=version) for g in evaluation.generate(policy, version or 1)
        ]
        log_.info(
            "generated %d completions from %s (version %s)", len(evaluation.prompts), checkpoint, version
        )
        del policy
    out = write_jsonl(
        Path(flags["--output"][0]) if "--output" in flags else eval_dir(cfg) / "generations.jsonl", rows
    )
    print(
        json.dumps({"generations": len(rows), "checkpoints": len(flags["--checkpoint"]), "output": str(out)})
    )
    return 0


def main(argv: Sequence[str]) -> int:
    return run_stage(
        run, argv, "generate", flags={"--checkpoint": True, "--output": False}, required=["--checkpoint"]
    )

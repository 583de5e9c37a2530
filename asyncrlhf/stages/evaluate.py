"""`asyncrlhf eval --config X --generations F [--output R]`: score `asyncrlhf generate`'s completions (the
seed's load-and-eval): per checkpoint, the mean gold reward, the win rate against the reference completions,
the KL to the reference policy and the reference perplexity (see `asyncrlhf.stages.evaluation`).

Writes R (default: F with `.results.json`): a JSON list, one object per checkpoint, with the same keys as the
evaluator service's `results.jsonl` rows (less the timing); prints each as a JSON line.
"""

from __future__ import annotations

import json
import logging
from collections import defaultdict
from collections.abc import Sequence
from pathlib import Path

from asyncrlhf.config import Config
from asyncrlhf.models import load_tokenizer, set_threads
from asyncrlhf.sampling.offline import Generation
from asyncrlhf.stages.common import read_jsonl, run_stage
from asyncrlhf.stages.evaluation import GoldEvaluation
from asyncrlhf.stages.generate import load_for_eval

log = logging.getLogger("asyncrlhf.eval")


def run(cfg: Config, log_: logging.Logger, flags: dict) -> int:
    set_threads(cfg.evaluator.threads)
    source = Path(flags["--generations"][0])
    by_checkpoint: dict[str, list[dict]] = defaultdict(list)
    for row in read_jsonl(source):
        by_checkpoint[row["checkpoint"]].append(row)
    evaluation = GoldEvaluation(cfg, load_tokenizer(cfg.model))
    results = []
    for checkpoint, rows in by_checkpoint.items():
        policy, _ = load_for_eval(cfg, checkpoint, str(evaluation.sampler.device))
        measures = evaluation.evaluate(policy, [Generation.from_row(r) for r in rows])
        version = rows[0].get("version")
        results.append(
            {
                "checkpoint": checkpoint,
                "version": version,
                "step": None if version is None else version - 1,
                **measures,
            }
        )
        print(json.dumps(results[-1]), flush=True)
        del policy
    out = Path(flags["--output"][0]) if "--output" in flags else source.with_suffix(".results.json")
    out.write_text(json.dumps(results, indent=2))
    log_.info("results of %d checkpoints written to %s", len(results), out)
    return 0


def main(argv: Sequence[str]) -> int:
    return run_stage(
        run, argv, "eval", flags={"--generations": False, "--output": False}, required=["--generations"]
    )

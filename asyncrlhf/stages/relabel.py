"""`asyncrlhf relabel --config X [overrides]`: preference pairs ordered by the gold reward (the seed's
`relabel_with_rm`).

Pairs come from `relabel.input` (JSONL {prompt, chosen, rejected}) or, when unset, from two samples of
`model.name_or_path` per train prompt (`generator.sampling`). Both sides are scored with `evaluator.gold`;
the higher becomes `chosen`. Pairs the gold reward cannot order (equal scores) are dropped. With given
pairs, the agreement rate of the gold reward with the original labels is printed.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Sequence

from asyncrlhf.config import Config
from asyncrlhf.models import encode_prompts, load_policy, load_tokenizer
from asyncrlhf.rewards import Item
from asyncrlhf.sampling.offline import PolicySampler
from asyncrlhf.stages.common import log_stage, read_records, run_path, run_stage, take, write_jsonl
from asyncrlhf.stages.sft import gold_scorer
from asyncrlhf.tasks import load_task

log = logging.getLogger("asyncrlhf.relabel")


def sampled_pairs(cfg: Config) -> list[dict]:
    """Two samples of the policy per train prompt, unlabelled (`a`, `b`)."""
    prompts = take(load_task(cfg.task).train, cfg.relabel.num_prompts)
    tokenizer = load_tokenizer(cfg.model)
    sampler = PolicySampler(
        cfg, tokenizer, cfg.generator.backend, cfg.generator.device, cfg.generator.batch_prompts
    )
    samples = sampler.generate(
        load_policy(cfg.model, device=str(sampler.device)),
        prompts,
        encode_prompts(tokenizer, prompts, cfg.model),
        2,
        cfg.generator.sampling,
    )
    return [
        {"prompt": p, "a": g[0].completion, "b": g[1].completion}
        for p, g in zip(prompts, samples, strict=True)
    ]


def relabel(pairs: Sequence[dict], gold, first: str, second: str) -> tuple[list[dict], dict]:
    """Order each pair by `gold`; `first`/`second` name the sides (`chosen`/`rejected` for labelled pairs).

    Returns the ordered pairs and a summary: pairs kept, ties dropped, and for labelled input the fraction
    of kept pairs where gold agrees with the original label."""
    items = [Item(p["prompt"], p[side]) for p in pairs for side in (first, second)]
    scores = gold.score(items).scores
    out, ties, agree = [], 0, 0
    for i, pair in enumerate(pairs):
        s1, s2 = scores[2 * i], scores[2 * i + 1]
        if s1 == s2:
            ties += 1
            continue
        agree += s1 > s2
        hi, lo = (
            ((pair[first], s1), (pair[second], s2)) if s1 > s2 else ((pair[second], s2), (pair[first], s1))
        )
        out.append(
            {
                "prompt": pair["prompt"],
                "chosen": hi[0],
                "rejected": lo[0],
                "chosen_score": hi[1],
                "rejected_score": lo[1],
            }
        )
    summary: dict[str, float | None] = {"pairs": len(out), "ties_dropped": ties}
    if first == "chosen":
        summary["agreement"] = agree / len(out) if out else None
    return out, summary


def run(cfg: Config, log_: logging.Logger, flags: dict) -> int:
    rc = cfg.relabel
    if rc.input:
        pairs, sides = read_records(rc.input, ["prompt", "chosen", "rejected"]), ("chosen", "rejected")
    else:
        pairs, sides = sampled_pairs(cfg), ("a", "b")
    ordered, summary = relabel(pairs, gold_scorer(cfg), *sides)
    out = write_jsonl(run_path(cfg, rc.output), ordered)
    log_stage(cfg, "relabel", **summary, output=str(out))
    if "agreement" in summary and summary["agreement"] is not None:
        log_.info(
            "gold reward agrees with the original labels on %.1f%% of %d pairs",
            100 * summary["agreement"],
            summary["pairs"],
        )
    print(json.dumps({**summary, "output": str(out)}))
    return 0


def main(argv: Sequence[str]) -> int:
    return run_stage(run, argv, "relabel")

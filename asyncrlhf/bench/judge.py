"""`asyncrlhf bench judge --config CONFIG.yaml [--samples N] [--steps S] [--json] [--out DIR] [overrides]`:
a language model as the judge (the config's first `reward.scorers[].kind: judge`), measured three ways.

1. Agreement with the gold reward: the initial policy samples N completions of the held-out prompts (two
   per prompt, the generator's sampling settings), `evaluator.gold` scores them and so does the judge. It
   prints the rank correlation (Spearman) of the two, and how often the judge orders two answers to one
   prompt as the gold does (ties half): what the judge can and cannot tell apart, on this task.
2. Judge calls per second: the N requests asked cold (no cache), batched as the reward service batches
   them, then asked again (every reply from the cache).
3. With --steps S: the pipeline (`asyncrlhf up`, S learner steps, no evaluator) twice, with the judge as the
   reward and with the gold rule as the reward, and prints s/step of each, the judge's calls/s inside the
   pipeline, and where a step's time goes (generation, scoring, training: seconds per step from the
   services' own metrics), naming the largest as what bounds the pipeline.
Writes result.json in --out.
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path
from typing import Any

import torch

from asyncrlhf.bench.pipeline import fresh_run_dirs, output_args, report, service_breakdown
from asyncrlhf.config import Config, JudgeScorerConfig, load_config
from asyncrlhf.config_cli import split_config_args
from asyncrlhf.consumed import Kind, rows_of

PHASES = ("generation", "scoring", "training")


def judge_of(cfg: Config) -> JudgeScorerConfig:
    judges = [s for s in cfg.reward.scorers if isinstance(s, JudgeScorerConfig)]
    if not judges:
        raise ValueError("the config has no judge: add a `reward.scorers: - kind: judge` (docs/judges.md)")
    return judges[0]


def samples(cfg: Config, n: int) -> list[dict[str, Any]]:
    """n completions of the held-out prompts by the initial policy, with their gold rewards."""
    from asyncrlhf.models import encode_prompts, load_policy, load_tokenizer
    from asyncrlhf.rewards import Item, build_reward
    from asyncrlhf.sampling.offline import PolicySampler
    from asyncrlhf.tasks import load_task, plain_text

    tokenizer = load_tokenizer(cfg.model)
    held_out = load_task(cfg.task).eval[: max(1, n // 2)]
    prompts = [plain_text(p) for p in held_out]
    torch.manual_seed(cfg.run.seed)
    sampler = PolicySampler(cfg, tokenizer, "hf", cfg.generator.device, batch_size=16)
    prompt_ids = encode_prompts(tokenizer, held_out, cfg.model)
    rows = sampler.generate(load_policy(cfg.model), prompts, prompt_ids, 2, cfg.generator.sampling)
    gens = [g for row in rows for g in row][:n]
    gold = build_reward(cfg.reward.model_copy(update={
        "scorers": [cfg.evaluator.gold], "missing_eos_penalty": None})).score(
        [Item(g.prompt, g.completion) for g in gens]).scores
    return [{"prompt": g.prompt, "completion": g.completion, "gold": s}
            for g, s in zip(gens, gold, strict=True)]


def ranks(values: torch.Tensor) -> torch.Tensor:
    """(n,) ranks from 0, ties given their mean rank."""
    order = values.argsort()
    ranked = torch.empty_like(values, dtype=torch.float64)
    ranked[order] = torch.arange(len(values), dtype=torch.float64)
    for v in values.unique():
        tied = values == v
        ranked[tied] = ranked[tied].mean()
    return ranked


def agreement(rows: list[dict[str, Any]], scores: list[float]) -> dict[str, float]:
    """Spearman correlation of judge and gold, and the share of same-prompt pairs with different gold that
    the judge orders as the gold does (a judge tie counts half)."""
    gold = torch.tensor([r["gold"] for r in rows], dtype=torch.float64)
    judged = torch.tensor(scores, dtype=torch.float64)
    a, b = ranks(gold) - ranks(gold).mean(), ranks(judged) - ranks(judged).mean()
    spearman = float((a * b).sum() / ((a.square().sum() * b.square().sum()).sqrt() + 1e-12))
    agree, pairs = 0.0, 0
    for i in range(len(rows)):
        for j in range(i + 1, len(rows)):
            if rows[i]["prompt"] == rows[j]["prompt"] and rows[i]["gold"] != rows[j]["gold"]:
                pairs += 1
                same = (gold[i] - gold[j]) * (judged[i] - judged[j])
                agree += 1.0 if same > 0 else 0.5 if judged[i] == judged[j] else 0.0
    return {"spearman": spearman, "pair_agreement": agree / pairs if pairs else float("nan"), "pairs": pairs}


def judge_calls(cfg: Config, rows: list[dict[str, Any]]) -> dict[str, Any]:
    """Judge the rows cold and again from the cache: scores, calls/s, parse failures."""
    from asyncrlhf.rewards.judge import Judge, JudgeScorer

    spec = judge_of(cfg)
    started = time.perf_counter()
    judge = Judge.from_config(spec, cfg.run.seed)
    loaded = time.perf_counter() - started
    scorer = JudgeScorer(judge, spec.parse_fail_reward)
    prompts, completions = [r["prompt"] for r in rows], [r["completion"] for r in rows]
    started = time.perf_counter()
    result = scorer.score(prompts, completions)
    cold = time.perf_counter() - started
    started = time.perf_counter()
    scorer.score(prompts, completions)
    cached = time.perf_counter() - started
    requests = len(judge.cache)  # distinct requests: each answered once, cold
    scorer.close()
    return {"scores": result.scores, "engine": judge.engine.identity, "load_s": loaded, "requests": requests,
            "calls_per_s": requests / cold, "cached_calls_per_s": requests / max(cached, 1e-9),
            "parse_failures": judge.parse_failures}


def pipeline(files: list[str], overrides: list[str], steps: int, root: Path) -> dict[str, Any]:
    """s/step with the judge as the reward and with the gold rule, and what bounds each."""
    from asyncrlhf.launcher import Launcher

    out: dict[str, Any] = {}
    gold = load_config(files, overrides).evaluator.gold.model_dump(mode="json")
    for name, extra in (("judge", []), ("rule", [f"reward.scorers=[{json.dumps(gold)}]"])):
        own = [*overrides, *extra, f"learner.total_steps={steps}", f"run.name=bench-{name}",
               f"run.dir={root / name}", "launch.evaluator=false", f"learner.checkpoint_every={steps}",
               "redis.persist=false"]
        cfg = load_config(files, own)
        if Launcher(cfg, files, own).run() != 0:
            raise RuntimeError(f"the {name} run failed; see {cfg.run.path / 'logs'}")
        summary = json.loads((cfg.run.path / "up_summary.json").read_text())
        trained = rows_of(cfg.run.path, Kind.TRAINED)
        final = summary["final_metrics"]
        breakdown = service_breakdown(final, len(trained))
        groups = sum(len(r.get("group_ids", [])) for r in trained)
        elapsed = trained[-1]["at"] - summary["started_at"]
        out[name] = {"s_per_step": (trained[-1]["at"] - trained[0]["at"]) / max(1, len(trained) - 1),
                     "breakdown": {p: breakdown[p] for p in PHASES},
                     "bound_by": max(PHASES, key=lambda p: breakdown[p]),
                     "judge_requests_per_s": (groups * requests_per_group(cfg) / elapsed
                                              if name == "judge" else 0.0)}
    out["judge_vs_rule_s_per_step"] = out["judge"]["s_per_step"] / out["rule"]["s_per_step"]
    return out


def requests_per_group(cfg: Config) -> int:
    """Judge requests one rollout group costs: k alone, k(k-1) pairwise (every pair in both orders)."""
    k = cfg.generator.samples_per_prompt
    return k * (k - 1) if judge_of(cfg).compare == "pairwise" else k


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(prog="asyncrlhf bench judge", description=__doc__.split("\n\n")[0])
    parser.add_argument("--config", action="append", required=True)
    parser.add_argument("--samples", type=int, default=32,
                        help="completions judged (two per held-out prompt)")
    parser.add_argument("--steps", type=int, default=0, help="pipeline steps per run (0: no pipeline runs)")
    output_args(parser, "runs/bench-judge")
    args, rest = parser.parse_known_args(argv)
    files, overrides = split_config_args([a for f in args.config for a in ("--config", f)] + rest)
    cfg = load_config(files, overrides)
    try:
        judge_of(cfg)
        fresh_run_dirs(Path(args.out), ["judge", "rule"] if args.steps else [], args.overwrite)
    except ValueError as err:
        parser.error(str(err))
    root = Path(args.out)
    root.mkdir(parents=True, exist_ok=True)
    rows = samples(cfg, args.samples)
    calls = judge_calls(cfg, rows)
    result = {"samples": len(rows), **agreement(rows, calls.pop("scores")), **calls,
              "examples": rows[:6]}
    if args.steps:
        result["pipeline"] = pipeline(files, overrides, args.steps, root)
    return report(result, root, args.json, print_summary)


def print_summary(result: dict) -> None:
    print(f"judge {result['engine']} (loaded in {result['load_s']:.1f} s) on {result['samples']} samples: "
          f"Spearman with the gold {result['spearman']:+.2f}, orders {result['pairs']} same-prompt pairs as "
          f"the gold does {100 * result['pair_agreement']:.0f}% of the time (chance: 50%); "
          f"{result['parse_failures']} replies did not parse")
    print(f"judge requests/s: {result['calls_per_s']:.2f} cold, {result['cached_calls_per_s']:.0f} from the "
          f"cache ({result['requests']} requests)")
    pipe = result.get("pipeline")
    if pipe:
        for name in ("judge", "rule"):
            r = pipe[name]
            phases = ", ".join(f"{p} {r['breakdown'][p]:.2f}" for p in PHASES)
            print(f"{name:>5} reward: {r['s_per_step']:.2f} s/step ({phases} s/step; bound by "
                  f"{r['bound_by']})"
                  + (f"; {r['judge_requests_per_s']:.2f} judge requests/s" if name == "judge" else ""))
        print(f"the judge costs {pipe['judge_vs_rule_s_per_step']:.2f}x the rule reward's s/step")

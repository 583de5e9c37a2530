"""`asyncrlhf bench dynamic [--config configs/dynamic_rloo.yaml] [--seeds 0,1,2] [--steps N]
[--checkpoint-every K] [--json] [--out DIR] [--overwrite | --keep] [overrides]`: dynamic sampling on and off,
trained through `asyncrlhf up`, compared at the same number of generated samples.

For each seed, two runs of the pipeline bench: `async1` (every group trained) and `dyn1` (groups whose rewards
are all equal filtered, each step refilled), with a checkpoint every K steps. Dynamic sampling consumes more
samples per step, so comparing them after the same number of steps would favour it; instead each checkpoint
is placed at the samples its run had consumed when it was made (groups trained or filtered by then, times
`samples_per_prompt`), and both runs are read at the same budget: the fewest samples either run of the seed
consumed in all. Prints per run the gold reward of the last checkpoint within that budget, the share of
groups filtered, and the mean trained completion length; then, over the seeds, on and off side by side with
their spread (min, mean, max), and the mean trained length on / off. With `--keep`, a run an earlier bench
finished in `--out` is read back instead of run again.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence
from pathlib import Path

from asyncrlhf import metrics as names
from asyncrlhf.bench.pipeline import evaluate, finished, fresh_run_dirs, output_args, report, run_one
from asyncrlhf.config_cli import split_config_args
from asyncrlhf.consumed import Kind, read_rows

DEFAULT_CONFIG = "configs/dynamic_rloo.yaml"
TARGET_LENGTH_RATIO = 0.1  # mean trained length, on vs off: within 10%


def consumed_by_version(rows: list[dict]) -> dict[int, int]:
    """Version -> groups the run had consumed (trained or filtered) when that version was trained."""
    out, consumed = {}, 0
    for row in sorted(rows, key=lambda r: r["at"]):
        if row["kind"] in (Kind.TRAINED, Kind.FILTERED):
            consumed += len(row["group_ids"])
        if row["kind"] == Kind.TRAINED:
            out[row["version"]] = consumed
    return out


def gold_at(run: dict, budget: int) -> tuple[float, int]:
    """(gold, samples) of the run's last checkpoint made within `budget` samples (the initial policy's: 0)."""
    best = (run["gold_by_version"].get(0, float("nan")), 0)
    for version, samples in sorted(run["samples_by_version"].items()):
        if samples <= budget and version in run["gold_by_version"]:
            best = (run["gold_by_version"][version], samples)
    return best


def describe(run: dict) -> dict:
    """What one run consumed and trained, from its consumed log and its learner's final metrics."""
    cfg = run["cfg"]
    rows = read_rows(cfg.run.path)
    k = cfg.generator.samples_per_prompt
    run["samples_by_version"] = {v: g * k for v, g in consumed_by_version(rows).items()}
    trained = sum(len(r["group_ids"]) for r in rows if r["kind"] == Kind.TRAINED)
    filtered = sum(len(r["group_ids"]) for r in rows if r["kind"] == Kind.FILTERED)
    tokens = sum(v.get(names.LEARNER_TOKENS_TOTAL, 0.0) for name, v in run["final_metrics"].items()
                 if name.startswith("learner"))
    return {"trained_groups": trained, "filtered_groups": filtered,
            "filtered_share": filtered / max(1, trained + filtered),
            "samples": (trained + filtered) * k, "mean_trained_length": tokens / max(1, trained * k)}


def compare(runs: list[dict], seeds: list[int]) -> dict:
    """Per seed, both runs read at the seed's common budget; over the seeds, on and off with their spread."""
    result: dict = {"runs": [], "seeds": seeds}
    for seed in seeds:
        off, on = (next(r for r in runs if r["name"] == f"{kind}-s{seed}") for kind in ("async1", "dyn1"))
        budget = min(off["described"]["samples"], on["described"]["samples"])
        for run in (off, on):
            gold, samples = gold_at(run, budget)
            result["runs"].append({"name": run["name"], "seed": seed, "budget_samples": budget,
                                   "gold_at_budget": gold, "checkpoint_samples": samples,
                                   "final_gold": run["gold"], **run["described"]})
    for kind in ("async1", "dyn1"):
        mine = [r for r in result["runs"] if r["name"].startswith(kind + "-")]
        golds = [r["gold_at_budget"] for r in mine]
        result[kind] = {"gold_min": min(golds), "gold_mean": sum(golds) / len(golds), "gold_max": max(golds),
                        "mean_trained_length": sum(r["mean_trained_length"] for r in mine) / len(mine),
                        "filtered_share": sum(r["filtered_share"] for r in mine) / len(mine)}
    on, off = result["dyn1"]["mean_trained_length"], result["async1"]["mean_trained_length"]
    result["length_on_vs_off"] = on / off
    result["length_within_target"] = abs(result["length_on_vs_off"] - 1) <= TARGET_LENGTH_RATIO
    return result


def main(argv: Sequence[str]) -> int:
    parser = argparse.ArgumentParser(prog="asyncrlhf bench dynamic")
    parser.add_argument("--config", action="append")
    parser.add_argument("--seeds", default="0,1,2")
    parser.add_argument("--steps", type=int, default=6)
    parser.add_argument("--checkpoint-every", type=int, default=2,
                        help="steps between the checkpoints scored (each costs a gold evaluation)")
    output_args(parser, "runs/bench-dynamic")
    parser.add_argument("--keep", action="store_true",
                        help="read the runs an earlier bench finished in --out instead of running them again "
                        "(an interrupted bench goes on where it stopped); unfinished ones need --overwrite")
    args, rest = parser.parse_known_args(argv)
    configs = args.config or [DEFAULT_CONFIG]
    files, overrides = split_config_args([a for f in configs for a in ("--config", f)] + rest)
    try:
        seeds = [int(s) for s in args.seeds.split(",") if s.strip()]
    except ValueError:
        parser.error(f"--seeds: give comma-separated integers, not {args.seeds!r}")
    if not seeds:
        parser.error("--seeds: give at least one seed")
    root = Path(args.out)
    plan = [(seed, f"{kind}-s{seed}") for seed in seeds for kind in ("async1", "dyn1")]
    kept = {name for _, name in plan if args.keep and finished(root / name, args.steps)}
    try:
        fresh_run_dirs(root, [name for _, name in plan if name not in kept], args.overwrite)
    except ValueError as err:
        parser.error(str(err))
    if kept:
        print(f"asyncrlhf bench dynamic: read back, not run again: {', '.join(sorted(kept))}",
              file=sys.stderr)
    runs = [run_one(files, [*overrides, f"run.seed={seed}"], name, args.steps, root,
                    checkpoint_every=args.checkpoint_every, reuse=name in kept)
            for seed, name in plan]
    evaluate(runs)
    for run in runs:
        run["described"] = describe(run)
    return report(compare(runs, seeds), root, args.json, print_table)


def print_table(result: dict) -> None:
    print(f"{'run':<12}{'budget':>8}{'gold@budget':>13}{'at samples':>12}{'final gold':>12}{'filtered':>10}"
          f"{'mean len':>10}")
    for r in result["runs"]:
        print(f"{r['name']:<12}{r['budget_samples']:>8}{r['gold_at_budget']:>13.3f}{r['checkpoint_samples']:>12}"
              f"{r['final_gold']:>12.3f}{100 * r['filtered_share']:>9.0f}%{r['mean_trained_length']:>10.1f}")
    for kind, label in (("async1", "dynamic sampling off"), ("dyn1", "dynamic sampling on")):
        s = result[kind]
        print(f"{label}: gold at the budget {s['gold_mean']:.3f} (min {s['gold_min']:.3f}, max "
              f"{s['gold_max']:.3f}) over {len(result['seeds'])} seeds; mean trained length "
              f"{s['mean_trained_length']:.1f}")
    verdict = "within" if result["length_within_target"] else "NOT within"
    print(f"mean trained length on / off: {result['length_on_vs_off']:.3f} ({verdict} 10%)")


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))

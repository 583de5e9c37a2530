"""`asyncrlhf bench pipeline --config configs/demo.yaml [--steps N] [--json]`: synchronous vs asynchronous
RLHF.

Runs the same number of learner steps with `max_staleness` 0 (synchronous: generation waits for training
and training for generation), 1 and 2, back to back through `asyncrlhf up`, then scores each run's
checkpoints on the held-out prompts with the gold reward. Prints per run: wall-clock per step (between the
first and last step, so start-up is excluded), generator idle fraction, learner waiting-for-data fraction,
final gold reward; and the speedup of async over sync. Writes `gold_vs_wallclock.png` in the bench dir.
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Sequence
from pathlib import Path

from asyncrlhf import metrics as names
from asyncrlhf.config import load_config
from asyncrlhf.config_cli import split_config_args

STALENESS = (0, 1, 2)


def _trained_rows(run_dir: Path) -> list[dict]:
    lines = (run_dir / "consumed.jsonl").read_text().splitlines()
    rows = [json.loads(line) for line in lines if line.strip()]
    return [r for r in rows if r["kind"] == "trained"]


def run_one(files: list[str], overrides: list[str], staleness: int, steps: int, root: Path) -> dict:
    from asyncrlhf.launcher import Launcher

    name = f"bench-async{staleness}" if staleness else "bench-sync"
    run_overrides = [*overrides, f"learner.max_staleness={staleness}", f"learner.total_steps={steps}",
                     f"run.name={name}", f"run.dir={root / name}", "launch.evaluator=false",
                     f"learner.checkpoint_every={max(1, steps // 2)}", "learner.keep_checkpoints=10",
                     "redis.persist=false"]
    cfg = load_config(files, run_overrides)
    if Launcher(cfg, files, run_overrides).run() != 0:
        raise RuntimeError(f"the {name} run failed; see {cfg.run.path / 'logs'}")
    summary = json.loads((cfg.run.path / "up_summary.json").read_text())
    rows = _trained_rows(cfg.run.path)
    span = rows[-1]["at"] - rows[0]["at"]
    learner = summary["final_metrics"].get("learner", {})
    generators = [v for k, v in summary["final_metrics"].items() if k.startswith("generator")]
    elapsed = rows[-1]["at"] - summary["started_at"]
    idle = sum(g.get(names.GENERATOR_IDLE_SECONDS_TOTAL, 0.0) for g in generators) / max(1, len(generators))
    return {
        "name": name, "cfg": cfg, "s_per_step": span / max(1, len(rows) - 1),
        "generator_idle_fraction": idle / elapsed,
        "learner_wait_fraction": learner.get(names.LEARNER_WAIT_SECONDS_TOTAL, 0.0) / elapsed,
        "step_times": {r["version"]: r["at"] - summary["started_at"] for r in rows},
    }


def evaluate(runs: list[dict]) -> None:
    """Gold reward of the initial policy and of every checkpoint of every run (after all runs, so scoring
    does not steal CPU from the runs being timed)."""
    from asyncrlhf.models import load_tokenizer
    from asyncrlhf.stages.evaluation import GoldEvaluation
    from asyncrlhf.training.checkpoint import load_checkpoint_policy, read_state, step_dirs

    first = runs[0]["cfg"]
    evaluation = GoldEvaluation(first, load_tokenizer(first.model))
    initial = evaluation.evaluate(evaluation.reference, evaluation.initial_generations())["gold_reward"]
    for run in runs:
        points = [(0.0, initial)]
        for ckpt in step_dirs(run["cfg"].run.path):
            version = read_state(ckpt).version
            policy = load_checkpoint_policy(str(ckpt), run["cfg"].model)
            gold = evaluation.evaluate(policy, evaluation.generate(policy, version))["gold_reward"]
            points.append((run["step_times"].get(version, float("nan")), gold))
        run["gold_curve"], run["gold"] = points, points[-1][1]


def plot(runs: list[dict], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6, 4))
    for run in runs:
        xs, ys = zip(*run["gold_curve"], strict=True)
        ax.plot(xs, ys, marker="o", label=f"{run['name']} ({run['s_per_step']:.1f} s/step)")
    ax.set_xlabel("wall-clock (s)")
    ax.set_ylabel("held-out gold reward")
    ax.set_title("Sync vs async RLHF: gold reward over time")
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def main(argv: Sequence[str]) -> int:
    parser = argparse.ArgumentParser(prog="asyncrlhf bench pipeline")
    parser.add_argument("--config", action="append", required=True)
    parser.add_argument("--steps", type=int, default=12)
    parser.add_argument("--json", action="store_true")
    parser.add_argument("--out", default="runs/bench-pipeline")
    args, rest = parser.parse_known_args(argv)
    files, overrides = split_config_args([a for f in args.config for a in ("--config", f)] + rest)
    root = Path(args.out)
    runs = [run_one(files, overrides, s, args.steps, root) for s in STALENESS]
    evaluate(runs)
    plot(runs, root / "gold_vs_wallclock.png")
    sync, async1, async2 = runs
    result = {
        "sync_s_per_step": sync["s_per_step"], "async1_s_per_step": async1["s_per_step"],
        "async2_s_per_step": async2["s_per_step"],
        "speedup_async1": sync["s_per_step"] / async1["s_per_step"],
        "speedup_async2": sync["s_per_step"] / async2["s_per_step"],
        "gold_sync": sync["gold"], "gold_async1": async1["gold"], "gold_async2": async2["gold"],
        "generator_idle": {r["name"]: r["generator_idle_fraction"] for r in runs},
        "learner_wait": {r["name"]: r["learner_wait_fraction"] for r in runs},
        "steps": args.steps, "plot": str(root / "gold_vs_wallclock.png"),
    }
    (root / "result.json").write_text(json.dumps(result, indent=2))
    if args.json:
        print(json.dumps(result))
        return 0
    print(f"{'run':<14}{'s/step':>9}{'gen idle':>10}{'learner wait':>14}{'final gold':>12}")
    for r in runs:
        print(f"{r['name']:<14}{r['s_per_step']:>9.2f}{r['generator_idle_fraction']:>10.2f}"
              f"{r['learner_wait_fraction']:>14.2f}{r['gold']:>12.3f}")
    print(f"speedup of async (max_staleness 1) over sync: {result['speedup_async1']:.2f}x; "
          f"(max_staleness 2): {result['speedup_async2']:.2f}x")
    print(f"plot: {result['plot']}")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))

"""`asyncrlhf bench pipeline --config configs/demo.yaml [--steps N] [--runs inprocess,sync,async1,...]
[--backend hf --backend vllm] [--json] [--out DIR] [--overwrite] [overrides]`: the services, synchronous and
asynchronous, beside one process doing the same work.

Runs the same number of learner steps as: `inprocess` (the library's sampling, reward and training in one
process on every core, no services: `asyncrlhf.bench.inprocess`), `sync` (`max_staleness` 0 through
`asyncrlhf up`: generation waits for training and training for generation), `async1` and `async2`
(`max_staleness` 1, 2), and async1 with one thing changed: `cont1` (`generator.mode=continuous`), `pack1`
(`learner.packing`), `dyn1` (`learner.dynamic_sampling`), `waitpush1` (`learner.background_publish=false`:
each step waits for its push), `tis1` (`learner.rollout_correction=tis`: every token weighted for the
engine's numerics; with `--backend vllm`), each set beside async1; then scores each run's checkpoints on the
held-out prompts with the gold reward and the KL to the reference. With
several `--backend`s, every run is made with each generator backend (names get `-<backend>`). Prints per run:
wall-clock per step (between the first and last step, so start-up is excluded), where a step's time goes
(generation, scoring, training, publish = gather + push, apply, learner waiting, generator idle: seconds per
step, from each service's own metrics), final gold reward and KL, and with `task.env` the episodes trained per
second; the speed of each service run against
`inprocess`, and the async run's overlap limit max(generation, training). Dotted overrides apply to every
run. Writes `gold_vs_wallclock.png` and `result.json` in the bench dir (`--out`); a run directory an earlier
bench left there is refused (the launcher would resume it) unless `--overwrite` replaces it.
"""

from __future__ import annotations

import argparse
import json
import shutil
import sys
from collections.abc import Callable, Sequence
from pathlib import Path

from asyncrlhf import metrics as names
from asyncrlhf.config import load_config
from asyncrlhf.config_cli import split_config_args
from asyncrlhf.consumed import Kind, rows_of

# name -> max_staleness (None: no services)
RUNS = {"inprocess": None, "sync": 0, "async1": 1, "async2": 2, "cont1": 1, "pack1": 1, "dyn1": 1,
        "waitpush1": 1, "tis1": 1}
# async1 with one thing changed, each set beside async1 in the summary (`vs_async1`)
VARIANTS = {"cont1": ["generator.mode=continuous"], "pack1": ["learner.packing=true"],
            "dyn1": ["learner.dynamic_sampling.enabled=true"],
            "waitpush1": ["learner.background_publish=false"], "tis1": ["learner.rollout_correction=tis"]}
TARGET_SYNC_VS_INPROCESS = 1.1  # sync s/step <= 1.1x inprocess
TARGET_ASYNC_SPEEDUP = 1.2  # async1 >= 1.2x faster than inprocess


def run_overrides(overrides: list[str], name: str, staleness: int, steps: int, root: Path,
                  checkpoint_every: int | None = None) -> list[str]:
    variant = VARIANTS.get(name.split("-")[0], [])
    return [*overrides, *variant, f"learner.max_staleness={staleness}", f"learner.total_steps={steps}",
            f"run.name=bench-{name}", f"run.dir={root / name}", "launch.evaluator=false",
            f"learner.checkpoint_every={checkpoint_every or max(1, steps // 2)}",
            f"learner.keep_checkpoints={max(10, steps)}",
            "redis.persist=false"]


def fresh_run_dirs(root: Path, run_names: Sequence[str], overwrite: bool) -> None:
    """Make sure no run of this bench starts in a directory an earlier bench left: a service run there would
    resume from its checkpoints, train nothing, and report the earlier run's figures as its own. With
    `overwrite`, those directories are removed; without it, nothing is touched and the error says what to
    do."""
    earlier = [root / name for name in run_names if (root / name).exists()]
    if not earlier:
        return
    if not overwrite:
        listed = ", ".join(str(d) for d in earlier)
        raise ValueError(f"{listed}: an earlier bench's runs are there (a service run would resume from "
                         "their checkpoints and time nothing); pass --overwrite to replace them, or --out "
                         "DIR to keep them")
    for directory in earlier:
        shutil.rmtree(directory)


def finished(run_dir: Path, steps: int) -> bool:
    """Whether an earlier bench completed this service run: `asyncrlhf up` wrote its summary with no failure
    and the consumed log holds `steps` trained steps (an unfinished run would resume, so it never counts)."""
    summary = run_dir / "up_summary.json"
    try:
        failed = json.loads(summary.read_text()).get("failed")
    except (OSError, ValueError):
        return False
    return failed is None and len(rows_of(run_dir, Kind.TRAINED)) >= steps


def run_one(files: list[str], overrides: list[str], name: str, steps: int, root: Path,
            checkpoint_every: int | None = None, reuse: bool = False) -> dict:
    """One run of the bench, or with `reuse` (a service run `finished` says is complete) its figures read
    back from its directory without running it again."""
    from asyncrlhf.bench.inprocess import run_inprocess
    from asyncrlhf.launcher import Launcher

    staleness = RUNS[name.split("-")[0]]
    own = run_overrides(overrides, name, staleness or 0, steps, root, checkpoint_every)
    if staleness is None:
        return {**run_inprocess(files, own), "name": name}
    cfg = load_config(files, own)
    if not reuse and Launcher(cfg, files, own).run() != 0:
        raise RuntimeError(f"the {name} run failed; see {cfg.run.path / 'logs'}")
    summary = json.loads((cfg.run.path / "up_summary.json").read_text())
    rows = rows_of(cfg.run.path, Kind.TRAINED)
    span = rows[-1]["at"] - rows[0]["at"]
    elapsed = rows[-1]["at"] - summary["started_at"]
    final = summary["final_metrics"]
    breakdown = service_breakdown(final, len(rows))
    if cfg.generator.mode == "continuous":  # groups overlap: their summed durations are not generation time
        breakdown["generation"] = (elapsed - breakdown["generator_idle"] * len(rows)) / len(rows)
    trained_tokens = sum(v.get(names.LEARNER_TOKENS_TOTAL, 0.0) for k, v in final.items()
                         if k.startswith("learner"))
    generated = sum(v.get(names.GENERATOR_TOKENS_TOTAL, 0.0) for k, v in final.items()
                    if k.startswith("generator"))
    s_per_step = span / max(1, len(rows) - 1)
    episodes_per_step = cfg.learner.groups_per_step * cfg.generator.samples_per_prompt
    return {
        "name": name, "cfg": cfg, "s_per_step": s_per_step, "breakdown": breakdown,
        "episodes_per_s": episodes_per_step / s_per_step if cfg.task.env.kind != "none" else 0.0,
        "trained_tokens_per_s": trained_tokens / elapsed, "generated_tokens_per_s": generated / elapsed,
        "generator_idle_fraction": breakdown["generator_idle"] * len(rows) / elapsed,
        "learner_wait_fraction": breakdown["learner_wait"] * len(rows) / elapsed,
        "step_times": {r["version"]: r["at"] - summary["started_at"] for r in rows}, "final_metrics": final,
    }


def service_breakdown(final: dict[str, dict[str, float]], steps: int) -> dict[str, float]:
    """Seconds per trained step in each phase, from the services' own metrics at the end of the run (start-up
    included: the first batches run before the first step). Generator figures are per generator (they work
    side by side), reward figures summed over replicas' scoring."""
    def total(prefix: str, metric: str) -> list[float]:
        return [v.get(metric, 0.0) for k, v in final.items() if k.startswith(prefix)]

    generators = max(1, len(total("generator", names.GENERATOR_BATCH_SECONDS + "_sum")))
    per_step = {
        "generation": sum(total("generator", names.GENERATOR_BATCH_SECONDS + "_sum")) / generators,
        "scoring": sum(total("reward", names.REWARD_SCORING_SECONDS + "_sum")),
        "training": sum(total("learner", names.LEARNER_STEP_SECONDS + "_sum")),
        "publish": sum(total("learner", names.LEARNER_PUBLISH_SECONDS + "_sum")),
        "apply": sum(total("generator", names.GENERATOR_WEIGHT_APPLY_SECONDS + "_sum")) / generators,
        "learner_wait": sum(total("learner", names.LEARNER_WAIT_SECONDS_TOTAL)),
        "generator_idle": sum(total("generator", names.GENERATOR_IDLE_SECONDS_TOTAL)) / generators,
    }
    return {phase: seconds / max(1, steps) for phase, seconds in per_step.items()}


def evaluate(runs: list[dict]) -> None:
    """Gold reward of the initial policy and of every checkpoint of every run, and each run's last KL to the
    reference (after all runs, so scoring does not steal CPU from the runs being timed)."""
    from asyncrlhf.models import load_tokenizer
    from asyncrlhf.stages.evaluation import GoldEvaluation
    from asyncrlhf.training.checkpoint import load_checkpoint_policy, read_state, step_dirs

    first = runs[0]["cfg"]
    evaluation = GoldEvaluation(first, load_tokenizer(first.model))
    initial = evaluation.evaluate(evaluation.reference, evaluation.initial_generations())["gold_reward"]
    for run in runs:
        points, run["gold_by_version"], run["kl"] = [(0.0, initial)], {0: initial}, 0.0
        for ckpt in step_dirs(run["cfg"].run.path):
            version = read_state(ckpt).version
            policy = load_checkpoint_policy(str(ckpt), run["cfg"].model)
            scores = evaluation.evaluate(policy, evaluation.generate(policy, version))
            points.append((run["step_times"].get(version, float("nan")), scores["gold_reward"]))
            run["gold_by_version"][version], run["kl"] = scores["gold_reward"], scores["kl"]
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


def summarise(runs: list[dict], steps: int, root: Path) -> dict:
    by_name = {r["name"]: r for r in runs}
    result: dict = {"steps": steps, "plot": str(root / "gold_vs_wallclock.png"), "runs": [
        {"name": r["name"], "backend": r["cfg"].generator.backend, "s_per_step": r["s_per_step"],
         "gold": r["gold"], "kl": r.get("kl"), "breakdown": r["breakdown"],
         "generator_idle_fraction": r["generator_idle_fraction"],
         "learner_wait_fraction": r["learner_wait_fraction"],
         "trained_tokens_per_s": r.get("trained_tokens_per_s", 0.0),
         "episodes_per_s": r.get("episodes_per_s", 0.0),
         "generated_tokens_per_s": r.get("generated_tokens_per_s", 0.0)} for r in runs]}
    for r in runs:  # the flat keys of the first backend's runs (names without a suffix, or the first one's)
        key = r["name"].split("-")[0]
        if f"{key}_s_per_step" not in result:
            result[f"{key}_s_per_step"], result[f"gold_{key}"] = r["s_per_step"], r["gold"]
    for name, r in by_name.items():
        base = by_name.get("inprocess" + name[len(name.split("-")[0]):])
        if base is not None and r is not base:
            result.setdefault("vs_inprocess", {})[name] = r["s_per_step"] / base["s_per_step"]
        if name.startswith("async"):
            b = r["breakdown"]
            result.setdefault("overlap_limit_s_per_step", {})[name] = max(b["generation"], b["training"])
    for name, r in by_name.items():
        batch = by_name.get("async1" + name[len(name.split("-")[0]):])
        if name.split("-")[0] in VARIANTS and batch is not None:
            ratios = result.setdefault("vs_async1", {})[name] = {
                "trained_tokens_per_s": r["trained_tokens_per_s"] / batch["trained_tokens_per_s"],
                "generated_tokens_per_s": r["generated_tokens_per_s"] / batch["generated_tokens_per_s"],
                "s_per_step": r["s_per_step"] / batch["s_per_step"]}
            if batch.get("episodes_per_s"):  # runs with task.env
                ratios["episodes_per_s"] = r.get("episodes_per_s", 0.0) / batch["episodes_per_s"]
    if "sync_s_per_step" in result:
        for key in ("async1", "async2"):
            if f"{key}_s_per_step" in result:
                result[f"speedup_{key}"] = result["sync_s_per_step"] / result[f"{key}_s_per_step"]
    if "inprocess_s_per_step" in result:
        result["targets"] = {"sync_vs_inprocess_max": TARGET_SYNC_VS_INPROCESS,
                             "async1_speedup_over_inprocess_min": TARGET_ASYNC_SPEEDUP}
    return result


def main(argv: Sequence[str]) -> int:
    parser = argparse.ArgumentParser(prog="asyncrlhf bench pipeline")
    parser.add_argument("--config", action="append", required=True)
    parser.add_argument("--steps", type=int, default=12)
    parser.add_argument("--runs", default=",".join(RUNS),
                        help=f"comma-separated, from {', '.join(RUNS)} (default: all)")
    parser.add_argument("--backend", action="append", choices=["hf", "vllm"],
                        help="generator backend of every run (repeat: --backend hf --backend vllm)")
    output_args(parser, "runs/bench-pipeline")
    args, rest = parser.parse_known_args(argv)
    files, overrides = split_config_args([a for f in args.config for a in ("--config", f)] + rest)
    names_ = [n.strip() for n in args.runs.split(",") if n.strip()]
    unknown = [n for n in names_ if n not in RUNS]
    if unknown or not names_:
        parser.error(f"--runs: unknown run(s) {unknown}; choose from {', '.join(RUNS)}")
    root = Path(args.out)
    backends = args.backend or [None]
    plan = [(b, n if len(backends) == 1 else f"{n}-{b}") for b in backends for n in names_]
    try:
        fresh_run_dirs(root, [name for _, name in plan], args.overwrite)
    except ValueError as err:
        parser.error(str(err))
    runs = [run_one(files, [*overrides, *([f"generator.backend={b}"] if b else [])], name, args.steps, root)
            for b, name in plan]
    evaluate(runs)
    plot(runs, root / "gold_vs_wallclock.png")
    return report(summarise(runs, args.steps, root), root, args.json, print_table)


def output_args(parser: argparse.ArgumentParser, out: str) -> None:
    """--json, --out and --overwrite, as every bench of runs through `asyncrlhf up` takes them."""
    parser.add_argument("--json", action="store_true")
    parser.add_argument("--out", default=out)
    parser.add_argument("--overwrite", action="store_true",
                        help="replace the runs an earlier bench left in --out (they would be resumed)")


def report(result: dict, root: Path, as_json: bool, table: Callable[[dict], None]) -> int:
    """Write `result` to the bench dir's result.json and print it: as JSON, or as `table` prints it."""
    (root / "result.json").write_text(json.dumps(result, indent=2))
    if as_json:
        print(json.dumps(result))
    else:
        table(result)
    return 0


def print_table(result: dict) -> None:
    phases = ("generation", "scoring", "training", "publish", "apply", "learner_wait", "generator_idle")
    short = {"generation": "gen", "scoring": "score", "training": "train", "publish": "pub",
             "learner_wait": "wait", "generator_idle": "idle"}
    print(f"{'run':<16}{'s/step':>8}{'gold':>8}{'kl':>7}  " + "".join(f"{short.get(p, p):>7}" for p in phases)
          + "   (seconds per step)" + f"{'train tok/s':>13}{'gen tok/s':>11}{'wait %':>8}{'idle %':>8}")
    for r in result["runs"]:
        b = r["breakdown"]
        kl = f"{r['kl']:>7.2f}" if r.get("kl") is not None else f"{'-':>7}"
        print(f"{r['name']:<16}{r['s_per_step']:>8.2f}{r['gold']:>8.3f}{kl}  "
              + "".join(f"{b[p]:>7.2f}" if p in b else f"{'-':>7}" for p in phases) + " " * 21
              + f"{r.get('trained_tokens_per_s', 0):>13.1f}{r.get('generated_tokens_per_s', 0):>11.1f}"
              + f"{100 * r.get('learner_wait_fraction', 0):>8.1f}"
              + f"{100 * r.get('generator_idle_fraction', 0):>8.1f}")
    for name, ratios in result.get("vs_async1", {}).items():
        per_s = ratios.get("episodes_per_s")
        episodes = f", episodes trained/s {per_s:.2f}x" if per_s is not None else ""
        print(f"{name} / async1: trained tokens/s {ratios['trained_tokens_per_s']:.2f}x, generated tokens/s "
              f"{ratios['generated_tokens_per_s']:.2f}x, s/step {ratios['s_per_step']:.2f}x{episodes}")
    for name, ratio in result.get("vs_inprocess", {}).items():
        print(f"{name}: {ratio:.2f}x the in-process s/step ({1 / ratio:.2f}x its speed)")
    for name, limit in result.get("overlap_limit_s_per_step", {}).items():
        print(f"{name}: overlap limit max(generation, training) = {limit:.2f} s/step")
    for key in ("async1", "async2"):
        if f"speedup_{key}" in result:
            print(f"speedup of {key} over sync: {result[f'speedup_{key}']:.2f}x")
    print(f"plot: {result['plot']}")


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))

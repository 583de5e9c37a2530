"""`asyncrlhf bench staleness`: how much each algorithm loses when it trains on older policies' samples.

The off-policy robustness study of Noukhovitch et al. 2024 ("Asynchronous RLHF", section 3): for each
algorithm and each staleness N, train through `asyncrlhf up` on the same prompts with the same sample budget
(`--steps` x `learner.groups_per_step` groups), seeds and settings, with `learner.staleness_mode: exact`
(every group N versions old; `--mode paper` for the paper's protocol), then score the final checkpoint on
the held-out prompts with the gold reward: gold reward, win rate against the initial policy's greedy
completions, KL to the initial policy. The training reward is the config's (`--reward-model DIR` swaps in a
proxy RM trained on gold-labelled pairs, as the paper does); the gold reward is `evaluator.gold`.

Writes, in `--out`: `results/<run>.json` per finished run (a study started again skips those, retrains an
unfinished run from scratch, and refuses a result made under other settings: another config or reward
model), `study.json`, `win_rate_vs_staleness.png`, `frontier.png`.

    asyncrlhf bench staleness --quick --json                  # tiny model, 2 algorithms x N in {0, 2}
    asyncrlhf bench staleness --config configs/demo.yaml --seeds 0 1
    asyncrlhf bench staleness --config configs/demo.yaml --seeds 0 1 --finished-only   # so far, no training
"""

from __future__ import annotations

import argparse
import hashlib
import json
import shutil
import statistics
import sys
import time
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, get_args

import yaml

from asyncrlhf.bench.digest import model_digest
from asyncrlhf.config import (
    BestOfNLearnerConfig,
    OnlineDPOLearnerConfig,
    PolicyGradientLearnerConfig,
    PPOLearnerConfig,
    load_config,
)
from asyncrlhf.config.loading import _deep_merge, _read_yaml
from asyncrlhf.config_cli import split_config_args
from asyncrlhf.consumed import Kind, rows_of

ALGORITHMS = ("online_dpo", "ppo", "rloo")
STALENESS = (0, 1, 2, 4, 8)
QUICK: dict[str, Any] = {
    "config": ["configs/tiny.yaml"], "algorithms": ["online_dpo", "rloo"], "staleness": [0, 2], "steps": 5,
    "overrides": ["evaluator.num_prompts=8", "learner.kl.coef=0.01"],
}
METRICS = ("gold_reward", "win_rate", "kl")
LEARNERS = (OnlineDPOLearnerConfig, PPOLearnerConfig, PolicyGradientLearnerConfig, BestOfNLearnerConfig)
ALGORITHM_SECTIONS = ("online_dpo", "ppo", "policy_gradient")


@dataclass
class Study:
    files: list[str]
    overrides: list[str]
    algorithms: list[str]
    staleness: list[int]
    seeds: list[int]
    steps: int
    mode: str
    root: Path
    train: bool = True  # False: `--finished-only`, the table and plots of the runs already finished
    evaluation: object = field(default=None, repr=False)  # the gold evaluation, made once
    digests: dict[str, str] = field(default_factory=dict, repr=False)  # model scorer path -> digest

    def name(self, algorithm: str, n: int, seed: int) -> str:
        return f"{algorithm}-{self.mode}{n}-seed{seed}"

    def algorithm_config(self, algorithm: str) -> list[str]:
        """The config files merged into one without the other algorithms' sections (configs/demo.yaml sets
        `learner.online_dpo`, which an rloo run must not carry), in `<out>/configs/<algorithm>.yaml`."""
        members = [m for m in LEARNERS if algorithm in get_args(m.model_fields["algorithm"].annotation)]
        if not members:
            raise SystemExit(f"asyncrlhf bench staleness: unknown algorithm {algorithm!r}")
        data: dict[str, Any] = {}
        for file in self.files:
            _deep_merge(data, _read_yaml(Path(file)))
        for section in ALGORITHM_SECTIONS:
            if section not in members[0].model_fields:
                data.get("learner", {}).pop(section, None)
        path = self.root / "configs" / f"{algorithm}.yaml"
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(yaml.safe_dump(data, sort_keys=False))
        return [str(path)]

    def run_overrides(self, algorithm: str, n: int, seed: int) -> list[str]:
        name = self.name(algorithm, n, seed)
        return [*self.overrides, f"learner.algorithm={algorithm}", f"learner.max_staleness={n}",
                f"learner.staleness_mode={self.mode}", f"learner.total_steps={self.steps}",
                f"run.seed={seed}", f"run.name=bench-{name}", f"run.dir={self.root / 'runs' / name}",
                "launch.evaluator=false", f"learner.checkpoint_every={self.steps}", "learner.sync_every=1",
                "redis.persist=false"]


def settings(study: Study, cfg) -> dict[str, str]:
    """What a run's result depends on besides its name: the resolved config, its run directory aside, with
    each model scorer's path replaced by a digest of the model (`digest.model_digest`: its tensors and
    settings, not how a library version serialised them; a reward model retrained, or moved, is told apart
    by what it computes with, not by its path). A result made under other settings is never reused."""
    data = cfg.model_dump(mode="json")
    data["run"]["dir"] = data["run"]["token"] = None
    for scorer in data["reward"]["scorers"]:
        if scorer["kind"] == "model":
            path = scorer["path"]
            if path not in study.digests:
                study.digests[path] = model_digest(Path(path))
            scorer["path"] = f"sha256:{study.digests[path]}"
    return {"config": hashlib.sha256(json.dumps(data, sort_keys=True).encode()).hexdigest()[:16],
            **{f"reward_model_{i}": s["path"] for i, s in enumerate(data["reward"]["scorers"])
               if s["kind"] == "model"}}


def pin_recorded_models(study: Study, cfg, recorded: dict[str, str]) -> None:
    """`--finished-only` trains nothing, so the reward models it compares results under are the ones the
    results recorded, not whatever is at the scorer's path on this machine (train-rm is deterministic on one
    machine, not across CPUs: a rebuild elsewhere has other tensors). The first result read pins each
    model scorer's digest; every other result must then match it and the rest of the config as usual."""
    for i, scorer in enumerate(cfg.reward.scorers):
        digest = recorded.get(f"reward_model_{i}", "")
        if scorer.kind == "model" and digest.startswith("sha256:"):
            study.digests.setdefault(scorer.path, digest.removeprefix("sha256:"))


def staleness_trained(run_dir: Path, n: int, mode: str) -> dict:
    """What the consumed log says was trained: the staleness histogram over all steps, and its min and max
    after the warm-up (under `exact`, the first N steps train on the initial policy's groups, staleness 0 to
    N - 1, by construction)."""
    rows = rows_of(run_dir, Kind.TRAINED)
    warmup = n if mode == "exact" else 0
    histogram = Counter(s for r in rows for s in r["staleness"])
    after = [s for r in rows if r["version"] - 1 > warmup for s in r["staleness"]]
    return {
        "min_staleness_trained": min(after) if after else None,
        "max_staleness_trained": max(after) if after else None,
        "warmup_steps": warmup, "staleness_histogram": {str(k): v for k, v in sorted(histogram.items())},
        "dropped": sum(len(r["group_ids"]) for r in rows_of(run_dir, Kind.DROPPED)),
        "steps": len(rows),
    }


def run_config(study: Study, algorithm: str, n: int, seed: int):
    files, overrides = study.algorithm_config(algorithm), study.run_overrides(algorithm, n, seed)
    return files, overrides, load_config(files, overrides)


def train(files: list[str], overrides: list[str], cfg) -> float:
    """One run through `asyncrlhf up`, from scratch; returns its training seconds."""
    from asyncrlhf.launcher import Launcher

    shutil.rmtree(cfg.run.path, ignore_errors=True)  # an unfinished run is never resumed mid-way
    started = time.perf_counter()
    if Launcher(cfg, files, overrides).run() != 0:
        raise RuntimeError(f"the run {cfg.run.name} failed; see {cfg.run.path / 'logs'}")
    return time.perf_counter() - started


def gold_evaluation(study: Study):
    """One evaluation for the whole study: the same held-out prompts, gold scorer and reference completions
    (cached under `<out>/reference`)."""
    if study.evaluation is None:
        from asyncrlhf.models import load_tokenizer
        from asyncrlhf.stages.evaluation import GoldEvaluation

        cfg = load_config(study.files, [*study.overrides, f"run.dir={study.root / 'reference'}"])
        study.evaluation = GoldEvaluation(cfg, load_tokenizer(cfg.model))
    return study.evaluation


def evaluate(study: Study, cfg) -> dict:
    from asyncrlhf.training.checkpoint import load_checkpoint_policy, read_state, step_dirs

    final = step_dirs(cfg.run.path)[-1]
    policy = load_checkpoint_policy(str(final), cfg.model)
    evaluation = gold_evaluation(study)
    scores = evaluation.evaluate(policy, evaluation.generate(policy, read_state(final).version))
    return {k: scores[k] for k in METRICS}


def reusable(path: Path, expected: dict[str, str]) -> dict | None:
    """A finished run's result, when it was made under the same settings; a result made under others stops
    the study with what differs (mixing them would compare runs that differ in more than N)."""
    if not path.exists():
        return None
    result = json.loads(path.read_text())
    made = result.get("settings", {})
    differ = sorted(k for k in {*made, *expected} if made.get(k) != expected.get(k))
    if differ:
        raise SystemExit(
            f"asyncrlhf bench staleness: {path} was made under other settings ({', '.join(differ)}: "
            f"{', '.join(f'{made.get(k)} there, {expected.get(k)} now' for k in differ)}). Give this study "
            f"another --out, or remove {path.parent} to retrain its runs under the current settings.")
    return result


def run_one(study: Study, algorithm: str, n: int, seed: int) -> dict | None:
    """The run's result, from `results/` when a previous invocation finished it under the same settings;
    None for a run not finished yet when the study trains nothing (`--finished-only`)."""
    path = study.root / "results" / f"{study.name(algorithm, n, seed)}.json"
    files, overrides, cfg = run_config(study, algorithm, n, seed)
    if not study.train:
        if not path.exists():
            return None
        pin_recorded_models(study, cfg, json.loads(path.read_text()).get("settings", {}))
    expected = settings(study, cfg)
    if (result := reusable(path, expected)) is not None or not study.train:
        return result
    seconds = train(files, overrides, cfg)
    result = {"algorithm": algorithm, "staleness": n, "mode": study.mode, "seed": seed,
              **staleness_trained(cfg.run.path, n, study.mode), **evaluate(study, cfg), "seconds": seconds,
              "settings": expected}
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(result, indent=2))
    return result


def summarize(runs: list[dict]) -> list[dict]:
    """Per algorithm x N: the mean over seeds of each metric and its spread (max - min)."""
    cells: dict[tuple[str, int], list[dict]] = {}
    for r in runs:
        cells.setdefault((r["algorithm"], r["staleness"]), []).append(r)
    out = []
    for (algorithm, n), rs in cells.items():
        row = {"algorithm": algorithm, "staleness": n, "seeds": len(rs)}
        for m in METRICS:
            values = [r[m] for r in rs]
            row[m], row[f"{m}_spread"] = statistics.fmean(values), max(values) - min(values)
        out.append(row)
    return out


def _axes():
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6, 4))
    return plt, fig, ax


def plot(table: list[dict], root: Path, mode: str) -> dict[str, str]:
    """Win rate vs N (error bars: the seed spread) and the win-rate / KL frontier, per algorithm."""
    paths = {"win_rate_vs_staleness": root / "win_rate_vs_staleness.png", "frontier": root / "frontier.png"}
    by_algorithm: dict[str, list[dict]] = {}
    for row in sorted(table, key=lambda r: r["staleness"]):
        by_algorithm.setdefault(row["algorithm"], []).append(row)
    plt, fig, ax = _axes()
    for algorithm, rows in by_algorithm.items():
        ax.errorbar([r["staleness"] for r in rows], [r["win_rate"] for r in rows], marker="o", capsize=3,
                    yerr=[r["win_rate_spread"] / 2 for r in rows], label=algorithm)
    ax.set_xlabel(f"staleness N (versions, mode {mode})")
    ax.set_ylabel("gold win rate vs the initial policy")
    ax.set_title("Off-policy robustness: win rate vs staleness")
    ax.legend()
    fig.tight_layout()
    fig.savefig(paths["win_rate_vs_staleness"], dpi=110)
    plt.close(fig)
    plt, fig, ax = _axes()
    for algorithm, rows in by_algorithm.items():
        points = ax.plot([r["kl"] for r in rows], [r["win_rate"] for r in rows], marker="o", label=algorithm)
        for r in rows:
            ax.annotate(f"N={r['staleness']}", (r["kl"], r["win_rate"]), fontsize=7,
                        color=points[0].get_color(), xytext=(3, 3), textcoords="offset points")
    ax.set_xlabel("KL to the initial policy (nats per completion)")
    ax.set_ylabel("gold win rate vs the initial policy")
    ax.set_title("Win rate / KL frontier per algorithm")
    ax.legend()
    fig.tight_layout()
    fig.savefig(paths["frontier"], dpi=110)
    plt.close(fig)
    return {k: str(v) for k, v in paths.items()}


def print_table(table: list[dict], runs: list[dict]) -> None:
    print(f"{'algorithm':<12}{'N':>3}{'seeds':>6}{'gold':>9}{'±':>7}{'win rate':>10}{'±':>7}"
          f"{'KL':>9}{'±':>7}")
    for r in sorted(table, key=lambda r: (r["algorithm"], r["staleness"])):
        print(f"{r['algorithm']:<12}{r['staleness']:>3}{r['seeds']:>6}{r['gold_reward']:>9.3f}"
              f"{r['gold_reward_spread']:>7.3f}{r['win_rate']:>10.3f}{r['win_rate_spread']:>7.3f}"
              f"{r['kl']:>9.3f}{r['kl_spread']:>7.3f}")
    trained = sorted({(r["min_staleness_trained"], r["max_staleness_trained"], r["staleness"])
                      for r in runs}, key=lambda t: t[2])
    print("staleness trained after the warm-up (min, max) per N: "
          + ", ".join(f"N={n}: ({lo}, {hi})" for lo, hi, n in trained))
    print(f"± is the spread (max - min) over seeds; {sum(r['seconds'] for r in runs):.0f} s of training")


def parse(argv: Sequence[str]) -> tuple[Study, bool]:
    parser = argparse.ArgumentParser(prog="asyncrlhf bench staleness", description=__doc__.split("\n")[0])
    parser.add_argument("--config", action="append", help="config file(s); default configs/demo.yaml")
    parser.add_argument("--algorithms", nargs="+", help=f"default {' '.join(ALGORITHMS)}")
    parser.add_argument("--staleness", nargs="+", type=int, help=f"values of N; default {STALENESS}")
    parser.add_argument("--seeds", nargs="+", type=int, default=[0])
    parser.add_argument("--steps", type=int, help="learner steps per run (the same budget for every run)")
    parser.add_argument("--mode", choices=("exact", "paper"), default="exact")
    parser.add_argument("--reward-model", help="a proxy RM directory (train-rm's output) to train against")
    parser.add_argument("--quick", action="store_true", help="tiny model, online_dpo and rloo, N in {0, 2}")
    parser.add_argument("--finished-only", action="store_true",
                        help="train nothing: the table and plots of the runs already finished in --out, the "
                             "others listed as missing (a study under way, or one algorithm's runs beside "
                             "another's)")
    parser.add_argument("--json", action="store_true")
    parser.add_argument("--out", default=None, help="default runs/bench-staleness[-quick]")
    args, rest = parser.parse_known_args(argv)
    quick: dict[str, Any] = QUICK if args.quick else {}
    configs = args.config or quick.get("config") or ["configs/demo.yaml"]
    files, overrides = split_config_args([a for f in configs for a in ("--config", f)] + rest)
    overrides = [*quick.get("overrides", []), *overrides]
    if args.reward_model:
        overrides.append(f"reward.scorers=[{{kind: model, path: {args.reward_model}}}]")
    staleness = args.staleness or quick.get("staleness") or list(STALENESS)
    steps = args.steps or quick.get("steps") or 2 * max(staleness) + 8
    if steps <= max(staleness) and args.mode == "exact":
        parser.error(f"--steps {steps} leaves no step after the warm-up of N={max(staleness)}: use more")
    out = Path(args.out or ("runs/bench-staleness-quick" if args.quick else "runs/bench-staleness"))
    study = Study(files, overrides, args.algorithms or quick.get("algorithms") or list(ALGORITHMS), staleness,
                  args.seeds, steps, args.mode, out, train=not args.finished_only)
    out.mkdir(parents=True, exist_ok=True)
    for algorithm in study.algorithms:  # fail before the first run, not after hours
        load_config(study.algorithm_config(algorithm), study.run_overrides(algorithm, max(staleness), 0))
    return study, args.json


def main(argv: Sequence[str]) -> int:
    study, as_json = parse(argv)
    study.root.mkdir(parents=True, exist_ok=True)
    started = time.perf_counter()
    results = {(a, n, seed): run_one(study, a, n, seed)
               for seed in study.seeds for a in study.algorithms for n in study.staleness}
    runs = [r for r in results.values() if r is not None]
    missing = [study.name(*key) for key, r in results.items() if r is None]
    if not runs:
        raise SystemExit(f"asyncrlhf bench staleness: no run of this study has finished in {study.root}; "
                         "run it without --finished-only to train them")
    table = summarize(runs)
    plots = plot(table, study.root, study.mode)
    result = {"mode": study.mode, "steps": study.steps, "seeds": study.seeds, "runs": runs,
              "missing": missing, "table": table, "plots": plots, "seconds": time.perf_counter() - started}
    (study.root / "study.json").write_text(json.dumps(result, indent=2))
    if as_json:
        print(json.dumps(result))
    else:
        print_table(table, runs)
        print(f"plots: {plots['win_rate_vs_staleness']}, {plots['frontier']}")
        if missing:
            print(f"not finished yet ({len(missing)}): {', '.join(missing)}")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))

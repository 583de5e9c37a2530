"""`asyncrlhf report RUN_DIR`: `report.md` and PNG plots of a run, from the files its services write.

Inputs, all optional (a missing one leaves its part of the report out):
  eval/results.jsonl   one row per evaluated policy version (the evaluator service, `asyncrlhf eval`)
  consumed.jsonl       the learner's record of trained / dropped / dead-lettered groups, with staleness
  stages.jsonl         summaries of the offline stages (sft, relabel, train-rm)

The one picture to look at is `plots/overview.png`: gold reward and win rate climbing with steps and wall
clock, the reward-vs-KL frontier moving up and to the right, and how stale the trained samples were.
Plots are drawn on `matplotlib.figure.Figure` with the Agg canvas: no pyplot, no global backend state.
"""

from __future__ import annotations

import json
import sys
from collections import Counter
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from asyncrlhf.consumed import ENDINGS, Kind, rows_of

RESULTS = Path("eval") / "results.jsonl"
STAGES = "stages.jsonl"
REPORT = "report.md"
PLOTS = "plots"
HEADLINE_KEYS = ("gold_reward", "win_rate", "kl", "judged_win_rate", "judged_win_rate_low",
                 "judged_win_rate_high")


def _rows(path: Path) -> list[dict[str, Any]]:
    """JSON lines of `path`; a torn last line (a writer mid-append) is skipped."""
    if not path.is_file():
        return []
    rows = []
    for line in path.read_text().splitlines():
        try:
            rows.append(json.loads(line))
        except json.JSONDecodeError:
            continue
    return rows


def load_results(run_dir: Path) -> list[dict[str, Any]]:
    """Evaluation rows ordered by version; a version evaluated twice keeps its last row."""
    by_version = {int(r["version"]): r for r in _rows(Path(run_dir) / RESULTS) if "version" in r}
    return [by_version[v] for v in sorted(by_version)]


def load_staleness(run_dir: Path) -> tuple[list[int], Counter[Kind]]:
    """Staleness (versions) of every trained group, and group counts by how they ended."""
    staleness: list[int] = []
    outcomes: Counter[Kind] = Counter()
    for row in rows_of(Path(run_dir), *ENDINGS):  # learner starts and groups enqueued again: no outcome
        outcomes[row["kind"]] += len(row.get("group_ids", []))
        if row["kind"] == Kind.TRAINED:
            staleness += [int(s) for s in row.get("staleness", [])]
    return staleness, outcomes


def headline(run_dir: Path) -> dict[str, Any]:
    """First and last gold reward / win rate / KL, the number of evaluations, and the report's path."""
    run_dir = Path(run_dir)
    results = load_results(run_dir)
    out: dict[str, Any] = {"evaluations": len(results), "report": str(run_dir / REPORT)}
    for label, row in (("first", results[0] if results else {}), ("last", results[-1] if results else {})):
        out[f"{label}_version"] = row.get("version")
        for key in HEADLINE_KEYS:
            out[f"{label}_{key}"] = row.get(key)
    return out


# ---------------------------------------------------------------------------------------------------------
# Plots


def _series(results: Sequence[dict], x: str, y: str) -> tuple[list[float], list[float]]:
    pairs = [(r[x], r[y]) for r in results if r.get(x) is not None and r.get(y) is not None]
    return [p[0] for p in pairs], [p[1] for p in pairs]


def _plot_metric(ax, results, x: str, y: str, xlabel: str, title: str, scale: float = 1.0) -> None:
    xs, ys = _series(results, x, y)
    ax.plot([v * scale for v in xs], ys, marker="o")
    if y == "win_rate":
        _plot_judged(ax, results, x, scale)
        ax.axhline(0.5, color="grey", linestyle="--", linewidth=1, label="reference (0.5)")
        ax.set_ylim(-0.02, 1.02)
        ax.legend(loc="best", fontsize=8)
    ax.set_xlabel(xlabel)
    ax.set_title(title)
    ax.grid(alpha=0.3)


def _plot_judged(ax, results, x: str, scale: float) -> None:
    """The judged win rate (evaluator.judge) beside the gold one, its bootstrap interval as error bars."""
    rows = [r for r in results if r.get("judged_win_rate") is not None and r.get(x) is not None]
    if not rows:
        return
    ax.lines[-1].set_label("gold reward")
    rates = [r["judged_win_rate"] for r in rows]
    errors = [[rate - r["judged_win_rate_low"] for rate, r in zip(rates, rows, strict=True)],
              [r["judged_win_rate_high"] - rate for rate, r in zip(rates, rows, strict=True)]]
    ax.errorbar([r[x] * scale for r in rows], rates, yerr=errors, marker="s", capsize=3, label="judged")


def _plot_frontier(ax, results) -> None:
    kls, golds = _series(results, "kl", "gold_reward")
    steps = [r["step"] for r in results if r.get("kl") is not None and r.get("gold_reward") is not None]
    ax.plot(kls, golds, color="lightgrey", zorder=1)
    points = ax.scatter(kls, golds, c=steps, cmap="viridis", zorder=2)
    if steps:
        ax.figure.colorbar(points, ax=ax, label="step")
    ax.set_xlabel("KL to the reference policy (nats)")
    ax.set_ylabel("gold reward")
    ax.set_title("Reward vs KL frontier")
    ax.grid(alpha=0.3)


def _plot_staleness(ax, staleness: list[int], outcomes: Counter[Kind]) -> None:
    if staleness:
        top = max(staleness)
        ax.hist(staleness, bins=[b - 0.5 for b in range(top + 2)], rwidth=0.8)
        ax.set_xticks(range(top + 1))
    else:
        ax.text(0.5, 0.5, "no trained groups recorded", ha="center", va="center", transform=ax.transAxes)
    ax.set_xlabel("staleness (policy versions)")
    ax.set_ylabel("groups trained")
    ax.set_title(
        f"Staleness (dropped {outcomes[Kind.DROPPED]}, dead-lettered {outcomes[Kind.DEAD_LETTERED]})"
    )
    ax.grid(alpha=0.3, axis="y")


def _figure(panels: int, columns: int):
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    rows = (panels + columns - 1) // columns
    width, height = 5.2 * columns, 3.8 * rows
    fig = Figure(figsize=(width, height))
    # fixed margins, in inches as the figure's size: a layout engine measured every label at each draw, half
    # of the plots' time (1.8 of 4.0 s for the seven PNGs) at the end of every run
    fig.subplots_adjust(left=0.75 / width, right=1 - 0.2 / width, bottom=0.55 / height,
                        top=1 - 0.4 / height, wspace=0.3, hspace=0.45)
    FigureCanvasAgg(fig)
    return fig, [fig.add_subplot(rows, columns, i + 1) for i in range(panels)]


def write_plots(
    results: Sequence[dict], staleness: list[int], outcomes: Counter[Kind], out_dir: Path
) -> dict[str, Path]:
    """One PNG per view plus `overview.png` with all of them; returns name -> path."""
    out_dir.mkdir(parents=True, exist_ok=True)
    minutes = 1 / 60
    views = {
        "gold_reward_vs_step": lambda ax: _plot_metric(
            ax, results, "step", "gold_reward", "step", "Gold reward"
        ),
        "win_rate_vs_step": lambda ax: _plot_metric(
            ax, results, "step", "win_rate", "step", "Win rate vs reference"
        ),
        "frontier": lambda ax: _plot_frontier(ax, results),
        "gold_reward_vs_time": lambda ax: _plot_metric(
            ax, results, "elapsed_s", "gold_reward", "minutes", "Gold reward vs wall clock", minutes
        ),
        "win_rate_vs_time": lambda ax: _plot_metric(
            ax, results, "elapsed_s", "win_rate", "minutes", "Win rate vs wall clock", minutes
        ),
        "staleness": lambda ax: _plot_staleness(ax, staleness, outcomes),
    }
    paths = {}
    fig, axes = _figure(len(views), 3)
    for ax, draw in zip(axes, views.values(), strict=True):
        draw(ax)
    paths["overview"] = out_dir / "overview.png"
    fig.savefig(paths["overview"], dpi=90)
    for name, draw in views.items():
        fig, (ax,) = _figure(1, 1)
        draw(ax)
        paths[name] = out_dir / f"{name}.png"
        fig.savefig(paths[name], dpi=90)
    return paths


# ---------------------------------------------------------------------------------------------------------
# The markdown


def _fmt(value: Any, digits: int = 3) -> str:
    if value is None:
        return "–"
    return f"{value:.{digits}f}" if isinstance(value, float) else str(value)


def judged_text(row: dict) -> str:
    """`0.562 [0.438, 0.688]`: a row's judged win rate and its bootstrap interval (`–` without one)."""
    rate, low, high = (row.get(k) for k in ("judged_win_rate", "judged_win_rate_low", "judged_win_rate_high"))
    if rate is None or low is None or high is None:
        return "–"
    return f"{rate:.3f} [{low:.3f}, {high:.3f}]"


def _verdict(results: Sequence[dict]) -> str:
    if not results:
        return "No evaluations yet."
    first, last = results[0], results[-1]
    if len(results) == 1:
        return f"One evaluation (version {first['version']}): gold reward {_fmt(first['gold_reward'])}."
    delta = last["gold_reward"] - first["gold_reward"]
    direction = "rose" if delta > 0 else ("fell" if delta < 0 else "did not move")
    judged = (f" Judged win rate against the reference {judged_text(last)} (evaluator.judge, both orders, "
              "ties half, bootstrap interval)." if "judged_win_rate" in last else "")
    return (
        f"Gold reward {direction} from {_fmt(first['gold_reward'])} to {_fmt(last['gold_reward'])} "
        f"({delta:+.3f}) over {last['step'] - first['step']} steps; win rate against the reference "
        f"{_fmt(last['win_rate'])}, at KL {_fmt(last['kl'])} nats.{judged}"
    )


def _results_table(results: Sequence[dict]) -> list[str]:
    """One row per version; a judged win rate column (with its interval) when any version has one."""
    judged = any("judged_win_rate" in r for r in results)
    lines = [
        "| version | step | elapsed (s) | gold reward | win rate | KL | perplexity | prompts |"
        + (" judged win rate [interval] |" if judged else ""),
        "|---:|---:|---:|---:|---:|---:|---:|---:|" + ("---:|" if judged else ""),
    ]
    for r in results:
        lines.append(
            f"| {r['version']} | {r['step']} | {_fmt(r.get('elapsed_s'), 1)} | {_fmt(r.get('gold_reward'))} "
            f"| {_fmt(r.get('win_rate'))} | {_fmt(r.get('kl'))} | {_fmt(r.get('perplexity'), 2)} "
            f"| {r.get('n_prompts', '–')} |" + (f" {judged_text(r)} |" if judged else "")
        )
    return lines


def _stages_section(run_dir: Path) -> list[str]:
    rows = _rows(run_dir / STAGES)
    if not rows:
        return []
    lines = ["", "## Offline stages", ""]
    for row in rows:
        details = ", ".join(f"{k} {_fmt(v)}" for k, v in row.items() if k not in ("stage", "time"))
        lines.append(f"- **{row['stage']}**: {details}")
    return lines


def write_report(run_dir: Path) -> Path:
    """Write `<run_dir>/report.md` and `<run_dir>/plots/*.png`; returns the report's path."""
    run_dir = Path(run_dir)
    results = load_results(run_dir)
    staleness, outcomes = load_staleness(run_dir)
    plots = write_plots(results, staleness, outcomes, run_dir / PLOTS)
    mean_staleness = sum(staleness) / len(staleness) if staleness else None
    lines = [
        f"# Run report: {run_dir.name}",
        "",
        _verdict(results),
        "",
        f"![overview]({PLOTS}/{plots['overview'].name})",
        "",
        "## Evaluations (gold reward)",
        "",
        *(_results_table(results) if results else ["No evaluations yet."]),
        "",
        "## Samples",
        "",
        (
            f"Groups trained {outcomes[Kind.TRAINED]}, "
            f"dropped as too stale {outcomes[Kind.DROPPED]}, "
            f"dead-lettered {outcomes[Kind.DEAD_LETTERED]}; mean staleness of trained groups "
            f"{_fmt(mean_staleness, 2)} versions."
        ),
        *_stages_section(run_dir),
        "",
        "## Plots",
        "",
        *[f"![{name}]({PLOTS}/{path.name})" for name, path in plots.items() if name != "overview"],
    ]
    path = run_dir / REPORT
    tmp = run_dir / f".{REPORT}.tmp"
    tmp.write_text("\n".join(lines) + "\n")
    tmp.replace(path)
    return path


USAGE = "usage: asyncrlhf report RUN_DIR"


def main(argv: Sequence[str] | None = None) -> int:
    args = list(sys.argv[1:] if argv is None else argv)
    if args in (["-h"], ["--help"]):
        print(USAGE)
        return 0
    if len(args) != 1 or args[0].startswith("-"):
        print(USAGE, file=sys.stderr)
        return 2
    run_dir = Path(args[0])
    if not run_dir.is_dir():
        print(f"asyncrlhf report: {run_dir} is not a directory (a run's `run.dir`)", file=sys.stderr)
        return 2
    path = write_report(run_dir)
    print(json.dumps({**headline(run_dir), "report": str(path)}))
    return 0


if __name__ == "__main__":
    sys.exit(main())

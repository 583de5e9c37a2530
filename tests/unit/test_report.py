"""`asyncrlhf report`: report.md and the PNGs from a run directory's files, and the headline numbers."""

import json

import pytest

from asyncrlhf.consumed import Kind, log_path
from asyncrlhf.report import headline, load_results, load_staleness, main, write_report

pytestmark = pytest.mark.unit


def write_rows(path, rows):
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))


def result(version, gold, win, kl, elapsed):
    return {
        "version": version,
        "step": version - 1,
        "checkpoint": "x",
        "time": 100.0 + elapsed,
        "elapsed_s": elapsed,
        "gold_reward": gold,
        "win_rate": win,
        "kl": kl,
        "perplexity": 3.0,
        "n_prompts": 8,
    }


@pytest.fixture
def run_dir(tmp_path):
    write_rows(
        tmp_path / "eval" / "results.jsonl",
        [
            result(1, 0.10, 0.5, 0.0, 0.0),
            result(5, 0.30, 0.7, 1.5, 60.0),
            result(3, 0.20, 0.6, 0.5, 30.0),
            result(5, 0.35, 0.75, 1.6, 61.0),  # re-evaluated: the last row of a version wins
        ],
    )
    write_rows(
        log_path(tmp_path),
        [
            {"kind": "trained", "version": 2, "group_ids": ["a", "b"], "staleness": [0, 1]},
            {"kind": "dropped", "version": 2, "group_ids": ["c"], "staleness": 3},
            {"kind": "trained", "version": 3, "group_ids": ["d", "e"], "staleness": [1, 1]},
            {"kind": "dead_lettered", "version": 3, "group_ids": ["f", "g"]},
        ],
    )
    (tmp_path / "eval" / "results.jsonl").open("a").write('{"version": 9, "gold')  # a torn last line
    return tmp_path


def test_results_sorted_by_version_last_row_wins(run_dir):
    assert [(r["version"], r["gold_reward"]) for r in load_results(run_dir)] == [
        (1, 0.1),
        (3, 0.2),
        (5, 0.35),
    ]


def test_staleness_of_trained_groups_and_outcome_counts(run_dir):
    staleness, outcomes = load_staleness(run_dir)
    assert sorted(staleness) == [0, 1, 1, 1]
    assert dict(outcomes) == {Kind.TRAINED: 4, Kind.DROPPED: 1, Kind.DEAD_LETTERED: 2}


def test_headline_first_and_last(run_dir):
    h = headline(run_dir)
    assert (h["first_gold_reward"], h["last_gold_reward"]) == (0.1, 0.35)
    assert (h["first_win_rate"], h["last_win_rate"], h["first_kl"], h["last_kl"]) == (0.5, 0.75, 0.0, 1.6)
    assert (h["evaluations"], h["first_version"], h["last_version"]) == (3, 1, 5)
    assert h["report"] == str(run_dir / "report.md")


def test_write_report_markdown_and_pngs(run_dir):
    path = write_report(run_dir)
    text = path.read_text()
    assert "Gold reward rose from 0.100 to 0.350 (+0.250) over 4 steps" in text
    assert "| 5 | 4 | 61.0 | 0.350 | 0.750 | 1.600 | 3.00 | 8 |" in text
    assert "dropped as too stale 1, dead-lettered 2; mean staleness of trained groups 0.75" in text
    for name in (
        "overview",
        "gold_reward_vs_step",
        "win_rate_vs_step",
        "gold_reward_vs_time",
        "win_rate_vs_time",
        "frontier",
        "staleness",
    ):
        png = run_dir / "plots" / f"{name}.png"
        assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and f"plots/{name}.png" in text


def test_an_empty_run_still_gets_a_report(tmp_path):
    text = write_report(tmp_path).read_text()
    assert "No evaluations yet." in text
    assert headline(tmp_path)["last_gold_reward"] is None


def test_cli(run_dir, capsys, tmp_path):
    assert main([str(run_dir)]) == 0
    assert json.loads(capsys.readouterr().out)["last_kl"] == 1.6
    assert main([str(tmp_path / "missing")]) == 2
    assert main([]) == 2


def test_a_judged_win_rate_is_reported_with_its_interval_beside_the_gold_one(tmp_path):
    judged = {"judged_win_rate": 0.625, "judged_win_rate_low": 0.5, "judged_win_rate_high": 0.75,
              "judged_ties": 0.25, "judged_unparsed": 0}
    write_rows(tmp_path / "eval" / "results.jsonl",
               [{**result(1, 0.1, 0.5, 0.0, 0.0), **judged, "judged_win_rate": 0.5},
                {**result(3, 0.2, 0.6, 0.5, 30.0), **judged}])
    text = write_report(tmp_path).read_text()
    assert "| judged win rate [interval] |" in text
    assert "| 3 | 2 | 30.0 | 0.200 | 0.600 | 0.500 | 3.00 | 8 | 0.625 [0.500, 0.750] |" in text
    assert "Judged win rate against the reference 0.625 [0.500, 0.750]" in text
    h = headline(tmp_path)
    assert (h["last_judged_win_rate"], h["last_judged_win_rate_low"], h["last_judged_win_rate_high"]) == (
        0.625, 0.5, 0.75)
    assert (tmp_path / "plots" / "win_rate_vs_step.png").is_file()

"""`asyncrlhf bench staleness --quick --json`, the real entry point: every run trains at exactly the staleness
it was asked for (after the warm-up), is scored with the gold reward, and a second invocation resumes."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.e2e

REPO = Path(__file__).resolve().parents[2]


def bench(out: Path, timeout: int = 600) -> dict:
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    cmd = [sys.executable, "-m", "asyncrlhf.cli", "bench", "staleness", "--quick", "--json",
           "--out", str(out)]
    proc = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=timeout)
    assert proc.returncode == 0, proc.stderr[-4000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])


def test_quick_study_trains_every_run_at_exactly_its_staleness_and_resumes(tmp_path):
    """Over 60 s because the quick study trains its 4 runs (2 algorithms x 2 staleness bounds, 5 steps each)
    one after another, scores each with the gold reward, and the second invocation trains the fourth again."""
    result = bench(tmp_path)
    runs = result["runs"]
    assert {(r["algorithm"], r["staleness"]) for r in runs} == {
        ("online_dpo", 0), ("online_dpo", 2), ("rloo", 0), ("rloo", 2)}
    for r in runs:
        assert r["min_staleness_trained"] == r["max_staleness_trained"] == r["staleness"], r
        assert r["steps"] == result["steps"] and r["seconds"] > 0
        assert 0.0 <= r["win_rate"] <= 1.0 and r["kl"] >= 0.0 and isinstance(r["gold_reward"], float)
        # the warm-up (first N steps) trained on the initial policy's groups, stated in the histogram
        assert r["warmup_steps"] == r["staleness"] and sum(r["staleness_histogram"].values()) == 5 * 4
    assert all(Path(p).stat().st_size > 0 for p in result["plots"].values())

    # interrupted after its third run: the next invocation retrains only the fourth
    (tmp_path / "results" / "rloo-exact2-seed0.json").unlink()
    again = bench(tmp_path)
    assert again["runs"][:3] == runs[:3]
    assert again["runs"][3]["min_staleness_trained"] == 2

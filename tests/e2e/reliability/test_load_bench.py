"""`asyncrlhf bench load` end to end on a short budget: the learner stalls, production stops at the credit
bound with flat queues and memory, and it resumes with nothing lost (the benchmark's own checks)."""

import os
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = [pytest.mark.e2e, pytest.mark.slow]
ROOT = Path(__file__).resolve().parents[3]


def test_bench_load_holds_every_check_on_a_short_run(tmp_path):
    cmd = [
        sys.executable,
        "-m",
        "asyncrlhf.cli",
        "bench",
        "load",
        "--generators",
        "2",
        "--rewards",
        "2",
        "--run-s",
        "20",
        "--stall-s",
        "24",
        "--after-s",
        "15",
        "--dir",
        str(tmp_path / "run"),
    ]
    done = subprocess.run(
        cmd,
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=900,
        env={**os.environ, "PYTHONPATH": str(ROOT)},
    )
    assert done.returncode == 0, done.stdout[-4000:] + done.stderr[-2000:]
    assert "FAIL" not in done.stdout and "OK: every group is accounted for" in done.stdout, done.stdout[
        -4000:
    ]

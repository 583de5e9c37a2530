"""`asyncrlhf up configs/tiny.yaml` as a user runs it: subprocess, embedded Redis, real gRPC, real
DeepSpeed."""

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from asyncrlhf.config import load_config
from asyncrlhf.training.checkpoint import latest_version

pytestmark = pytest.mark.e2e
ROOT = Path(__file__).resolve().parents[2]


def up(tmp_path, *overrides, config="configs/tiny.yaml", **popen):
    cmd = [sys.executable, "-m", "asyncrlhf.cli", "up", config, f"run.dir={tmp_path}/run",
           f"run.name=e2e-{tmp_path.name}", *overrides]
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    return subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                            text=True, **popen)


def finish(proc, timeout=300) -> tuple[int, str]:
    try:
        out, _ = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        proc.kill()
        out, _ = proc.communicate()
        pytest.fail(f"asyncrlhf up did not finish in {timeout}s:\n{out[-4000:]}")
    return proc.returncode, out


def test_up_runs_the_whole_pipeline_and_writes_the_report(tmp_path):
    code, out = finish(up(tmp_path, "generator.replicas=2", "learner.total_steps=4"))
    assert code == 0, out[-4000:]
    run = tmp_path / "run"
    summary = json.loads((run / "up_summary.json").read_text())
    assert summary["learner_version"] == 5  # 4 steps taken: version = steps + 1
    assert len(summary["generator_versions"]) == 2
    assert all(v == 5 for v in summary["generator_versions"].values()), summary["generator_versions"]
    answered = summary["metrics_answered"]
    assert answered and all(answered.values()), answered
    assert set(answered) == {"reward-0", "generator-0", "generator-1", "learner", "evaluator"}
    results = [json.loads(line) for line in (run / "eval" / "results.jsonl").read_text().splitlines()]
    assert results[0]["version"] == 1 and results[-1]["version"] == 5
    assert (run / "report.md").is_file() and "Report:" in out
    for name in ("learner", "generator-0", "generator-1", "reward-0", "evaluator"):
        assert (run / "logs" / f"{name}.log").stat().st_size > 0


def test_a_crashed_service_stops_the_run_with_its_log_tail(tmp_path):
    process = up(tmp_path, "reward.scorers=[{kind: rule, name: no_such_rule}]", "launch.evaluator=false")
    code, out = finish(process, timeout=180)
    assert code == 1
    assert "reward-0 exited with code" in out and "no_such_rule" in out


def test_sigint_stops_everything_and_leaves_a_resumable_checkpoint(tmp_path):
    proc = up(tmp_path, "learner.total_steps=1000", "launch.evaluator=false", start_new_session=True)
    consumed = tmp_path / "run" / "consumed.jsonl"
    deadline = time.monotonic() + 180
    while not (consumed.exists() and len(consumed.read_text().splitlines()) >= 2):
        assert proc.poll() is None and time.monotonic() < deadline, proc.stdout.read()[-4000:]
        time.sleep(0.2)
    os.killpg(proc.pid, signal.SIGINT)
    code, out = finish(proc, timeout=180)
    assert code == 130, out[-4000:]
    version = latest_version(load_config([tmp_path / "run" / "config.yaml"]))
    trained = [json.loads(line)["version"] for line in consumed.read_text().splitlines()
               if json.loads(line)["kind"] == "trained"]
    assert version == max(trained)  # the checkpoint holds every trained step: nothing to redo
    leftover = subprocess.run(["pgrep", "-f", f"e2e-{tmp_path.name}"], capture_output=True, text=True)
    assert leftover.stdout.strip() == "", "services still running after the stop"

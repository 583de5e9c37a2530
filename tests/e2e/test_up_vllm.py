"""`asyncrlhf up configs/tiny.yaml generator.backend=vllm` on vLLM's CPU build: trains to its total steps,
the generator's version follows the learner's, and the audit accounts for every group."""

import json
import subprocess
import sys

import pytest

from tests.e2e.test_up import ROOT, finish, up

pytestmark = [pytest.mark.e2e, pytest.mark.vllm]


def test_up_with_the_vllm_generator_trains_with_a_clean_audit(tmp_path):
    code, out = finish(up(tmp_path, "generator.backend=vllm", "model.tiny.heads=2",
                          f"model.cache_dir={tmp_path}/cache", "learner.total_steps=4"), timeout=900)
    assert code == 0, out[-4000:]
    run = tmp_path / "run"
    summary = json.loads((run / "up_summary.json").read_text())
    assert summary["learner_version"] == 5  # 4 steps: version = steps + 1
    assert list(summary["generator_versions"].values()) == [5], summary["generator_versions"]
    audit = subprocess.run([sys.executable, "-m", "asyncrlhf.cli", "audit", str(run), "--json"], cwd=ROOT,
                           capture_output=True, text=True, timeout=300)
    assert audit.returncode == 0, audit.stdout[-2000:] + audit.stderr[-2000:]
    assert not list((tmp_path / "cache" / "vllm").glob("work-*")), "the backend's work dir outlived it"

"""A user's DeepSpeed JSON on 2 real ranks (gloo): ZeRO-0/1/2/3, full and LoRA, its AdamW is the optimizer,
and the weights pushed to a real WeightSync receiver equal the learner's gathered weights."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.integration
ROOT = Path(__file__).resolve().parents[3]


@pytest.fixture(scope="module")
def results(tmp_path_factory):
    out = tmp_path_factory.mktemp("zero")
    env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"}
    log = out / "torchrun.log"
    with log.open("w") as f:
        cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2",
               "tests/integration/training/zero_worker.py", str(out)]
        proc = subprocess.run(cmd, cwd=ROOT, env=env, stdout=f, stderr=subprocess.STDOUT, timeout=600)
    assert proc.returncode == 0, log.read_text()[-4000:]
    return {(r["stage"], r["lora"]): r for r in json.loads((out / "results.json").read_text())}


CASES = [(stage, lora) for stage in (0, 1, 2, 3) for lora in (False, True)]
IDS = [f"zero{s}-{'lora' if lo else 'full'}" for s, lo in CASES]


@pytest.mark.parametrize(("stage", "lora"), CASES, ids=IDS)
def test_json_stage_drives_the_engine_and_pushed_weights_equal_gathered(results, stage, lora):
    r = results[(stage, lora)]
    assert r["effective_stage"] == r["engine_stage"] == stage
    assert r["push"] == "ok", r["detail"]
    assert r["same_names"] and r["nonempty"] and r["trained"]
    assert r["received_equals_gathered"]


@pytest.mark.parametrize("stage", [0, 3])
def test_the_json_adamw_lr_and_betas_are_the_optimizer_s(results, stage):
    r = results[(stage, False)]
    assert r["optimizer"] == "AdamW"
    assert r["lr"] == pytest.approx(1e-3) and r["betas"] == pytest.approx([0.8, 0.95])
    assert f"ZeRO stage {stage}, optimizer AdamW lr 0.001 betas (0.8, 0.95)" in r["settings"]

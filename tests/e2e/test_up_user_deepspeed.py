"""`asyncrlhf up` with the user's own ZeRO-3 + AdamW DeepSpeed JSON: the run ends with a checkpoint, every
push is accepted (the gathered weights, not the empty partitions), and the log states the JSON's lr."""

import json

import pytest
from safetensors import safe_open

from asyncrlhf.training.checkpoint import HF, step_dir
from tests.e2e.test_up import finish, up

pytestmark = pytest.mark.e2e


def test_up_with_a_zero3_adamw_json_checkpoints_and_logs_the_effective_lr(tmp_path):
    ds = tmp_path / "zero3.json"
    ds.write_text(json.dumps({
        "train_micro_batch_size_per_gpu": "auto", "gradient_accumulation_steps": 1,
        "zero_optimization": {"stage": 3},
        "optimizer": {"type": "AdamW", "params": {"lr": 0.001, "betas": [0.9, 0.95], "weight_decay": 0.0}},
    }))
    code, out = finish(up(tmp_path, f"learner.deepspeed.config_file={ds}", "learner.total_steps=4",
                          "launch.evaluator=false"))
    assert code == 0, out[-4000:]
    run = tmp_path / "run"
    log = (run / "logs" / "learner.log").read_text()
    assert "deepspeed in effect: ZeRO stage 3, optimizer AdamW lr 0.001 betas (0.9, 0.95)" in log
    assert "optimizer.params.lr=0.001 wins over learner.lr=0.0001" in log
    assert json.loads((run / "up_summary.json").read_text())["learner_version"] == 5
    with safe_open(str(step_dir(run, 5) / HF / "model.safetensors"), "pt") as f:
        assert all(f.get_slice(name).get_shape()[0] > 0 for name in f.keys())  # gathered, not partitions
    assert "reject" not in (run / "logs" / "generator-0.log").read_text().lower()

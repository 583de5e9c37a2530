"""A learner alone on CPU compiles nothing at start: DeepSpeed's shared-memory comm op (a JIT build of
minutes on a fresh machine) is skipped for a world of one, and a DeepSpeed engine still trains a step."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

pytestmark = pytest.mark.integration

SCRIPT = """
import torch
from asyncrlhf.config.learner import OnlineDPOLearnerConfig
from asyncrlhf.training import engine

print("world", engine.init_distributed())
model = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.Linear(8, 1))
policy = engine.initialize(model, OnlineDPOLearnerConfig(micro_batch_size=2, total_steps=2))
loss = policy(torch.randn(2, 8)).pow(2).mean()
policy.backward(loss)
policy.step()
print("stepped")
"""


def test_a_cpu_learner_alone_builds_no_extension(tmp_path):
    extensions = tmp_path / "torch_extensions"  # a fresh machine: nothing built yet
    extensions.mkdir()
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK")}
    env.update(TORCH_EXTENSIONS_DIR=str(extensions), CUDA_VISIBLE_DEVICES="")
    done = subprocess.run([sys.executable, "-c", SCRIPT], env=env, capture_output=True, text=True,
                          timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    assert "world (0, 1)" in done.stdout and "stepped" in done.stdout
    assert list(extensions.iterdir()) == []  # nothing was JIT-compiled

"""deploy/gpu_smoke.py without a GPU: its arguments, when its tensor-parallel step runs, and the configs it
starts engines with (the smoke itself needs CUDA; deploy/gpu-smoke runs it)."""

from __future__ import annotations

import importlib.util
import os
import subprocess
import sys

import pytest

from tests.unit.deploy.helpers import DEPLOY, ROOT

pytestmark = pytest.mark.unit


@pytest.fixture(scope="module")
def smoke():
    spec = importlib.util.spec_from_file_location("gpu_smoke", DEPLOY / "gpu_smoke.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_help_runs_without_a_gpu_and_names_the_tensor_parallel_option():
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    out = subprocess.run([sys.executable, str(DEPLOY / "gpu_smoke.py"), "--help"], cwd=ROOT, check=False,
                         capture_output=True, text=True, timeout=120, env=env)
    assert out.returncode == 0, out.stderr
    assert "--tp N" in out.stdout and "tensor_parallel_size" in out.stdout


def test_tp_defaults_to_one_and_refuses_less(smoke, capsys):
    assert smoke.parse_args([]).tp == 1
    assert smoke.parse_args(["--tp", "2"]).tp == 2
    for bad in (["--tp", "0"], ["--tp", "two"]):
        with pytest.raises(SystemExit) as exit_:
            smoke.parse_args(bad)
        assert exit_.value.code == 2
    assert "--tp 0: give the number of GPUs" in capsys.readouterr().err


@pytest.mark.parametrize("tp, visible, runs, reason", [
    (1, 8, False, "not asked for"),
    (2, 1, False, "--tp 2 needs 2 GPUs, 1 visible"),
    (4, 2, False, "--tp 4 needs 4 GPUs, 2 visible"),
    (2, 2, True, None),
    (2, 8, True, None),
])
def test_tensor_parallel_step_runs_only_with_enough_gpus(smoke, tp, visible, runs, reason):
    skipped = smoke.tensor_parallel_skipped(tp, visible)
    assert (skipped is None) is runs
    if reason:
        assert reason in skipped


def test_the_tensor_parallel_engine_config_loads(smoke, tmp_path):
    cfg = smoke.smoke_config(str(tmp_path), "generator.tensor_parallel_size=2")
    assert cfg.generator.tensor_parallel_size == 2 and cfg.generator.backend == "vllm"
    assert cfg.model.dtype == "float32", "parity with the fp32 learner needs an fp32 engine"

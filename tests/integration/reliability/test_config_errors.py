"""Config mistakes through every entry point: exit code 2, the dotted key and what to do, no traceback, and
nothing started."""

from __future__ import annotations

import os
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

pytestmark = pytest.mark.integration
ROOT = Path(__file__).resolve().parents[3]


@pytest.fixture(scope="module")
def bad_files(tmp_path_factory):
    d = tmp_path_factory.mktemp("configs")
    (d / "not_yaml.yaml").write_text("learner: [unclosed\n")
    (d / "a_list.yaml").write_text("- just\n- a list\n")
    return d


CASES = [
    (["up", "configs/tiny.yaml", "learner.lrr=1e-5"], "did you mean `learner.lr`"),
    (["up", "configs/tiny.yaml", "generator.replicas=many"], "generator.replicas"),
    (["up", "configs/tiny.yaml", "learner.max_staleness=-1"], "greater than or equal to 0"),
    (["up", "configs/tiny.yaml", "learner.algorithm=ppo2"], "learner.algorithm"),
    (["up", "configs/tiny.yaml", "--learner.lr"], "has no value"),
    (["learner", "--config", "configs/no_such.yaml"], "does not exist"),
    (["generator", "--config", "{bad}/not_yaml.yaml"], "is not valid YAML"),
    (["reward", "--config", "{bad}/a_list.yaml"], "must hold a mapping"),
    (["evaluator", "--config", "configs/tiny.yaml", "evaluator.nope=1"], "unknown key `evaluator.nope`"),
    (["audit", "--config", "configs/tiny.yaml", "redis.urll=redis://x"], "did you mean `redis.url`"),
    (["config", "show", "configs/tiny.yaml", "run.seed=zero"], "run.seed"),
    (["config", "show", "configs/tiny.yaml", "learner.algorithm=ppo", "learner.beta=0.2"],
     "`learner.beta` is online DPO's, now `learner.online_dpo.beta`"),
]


@pytest.mark.parametrize("args, message", CASES, ids=[" ".join(a[:1] + a[2:]) for a, _ in CASES])
def test_a_config_error_exits_2_with_the_key_and_no_traceback(bad_files, args, message):
    args = [a.replace("{bad}", str(bad_files)) for a in args]
    done = subprocess.run(
        [sys.executable, "-m", "asyncrlhf.cli", *args],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=120,
        env={**os.environ, "PYTHONPATH": str(ROOT)},
    )
    out = done.stdout + done.stderr
    assert done.returncode == 2, out[-2000:]
    assert message in out and "Traceback" not in out, out[-2000:]


HELP = ["learner", "generator", "reward", "evaluator", "sft", "train-rm", "relabel", "generate", "eval",
        "pipeline", "config", "up", "audit", "report"]


def test_help_on_every_command_prints_its_usage_and_exits_0():
    # `--help` used to read as an override without a value on every config-taking command (exit 2)
    def helped(command: str) -> subprocess.CompletedProcess:
        return subprocess.run([sys.executable, "-m", "asyncrlhf.cli", command, "--help"], cwd=ROOT,
                              capture_output=True, text=True, timeout=120,
                              env={**os.environ, "PYTHONPATH": str(ROOT)})

    with ThreadPoolExecutor(max_workers=3) as pool:  # each starts Python and its imports: in parallel
        runs = list(pool.map(helped, HELP))
    for command, done in zip(HELP, runs, strict=True):
        out = done.stdout + done.stderr
        assert done.returncode == 0 and "has no value" not in out and "Traceback" not in out, (command, out)
        assert f"asyncrlhf {command}" in out or f"services.{command}" in out, (command, out)

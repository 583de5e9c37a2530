"""`python -m services.reward` refuses bad configs with exit code 2 and says what to change."""

import subprocess
import sys

import pytest

from tests.integration.reward.test_replicas import REPO

pytestmark = pytest.mark.integration


def run_reward(*overrides):
    return subprocess.run(
        [sys.executable, "-m", "services.reward", "--config", str(REPO / "configs/tiny.yaml"), *overrides],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=120,
    )


def test_unknown_rule_exits_2_with_a_suggestion(redis_url):
    done = run_reward(f"redis.url={redis_url}", "reward.scorers=[{kind: rule, name: sentimnet}]")
    assert done.returncode == 2 and "did you mean `sentiment`" in done.stderr


def test_missing_redis_url_exits_2():
    done = run_reward()
    assert done.returncode == 2 and "redis.url is not set" in done.stderr

"""`make test`'s workers take the suite a group at a time (tests/schedule.py): a test file stays on one
worker, and after a test that put a vLLM engine in the test process, its worker runs no other kind of test.
Checked on a real `pytest -n 2 --dist loadgroup` run of a few quick files (pytest 9.2 had silently made
xdist's own grouping a no-op: each test went to whichever worker was free)."""

import importlib.util
import os
import re
import subprocess
import sys
from collections import defaultdict
from pathlib import Path

import pytest

pytestmark = pytest.mark.integration
ROOT = Path(__file__).resolve().parents[2]
FILES = ["tests/unit/test_free_port.py", "tests/unit/test_chat_format.py"]
ENGINE_FILE = "tests/integration/vllm/test_install.py"  # vllm-marked, outside tests/e2e: an engine group


def test_a_file_runs_on_one_worker_and_nothing_runs_after_an_engine_in_its_process():
    with_engine = importlib.util.find_spec("vllm") is not None
    files = FILES + ([ENGINE_FILE] if with_engine else [])
    env = {k: v for k, v in os.environ.items() if not k.startswith(("PYTEST_XDIST", "ASYNCRLHF_TEST_GROUPS"))}
    done = subprocess.run([sys.executable, "-m", "pytest", "-n", "2", "--dist", "loadgroup", "-v",
                           "-p", "no:cacheprovider", *files], cwd=ROOT, env=env, capture_output=True,
                          text=True, timeout=300)
    assert done.returncode == 0, done.stdout[-3000:]
    ran = re.findall(r"^\[(gw\d+)\] \[ *\d+%\] PASSED (\S+)", done.stdout, re.M)  # in the order they ended
    workers: dict[str, set[str]] = defaultdict(set)  # file -> the workers that ran its tests
    for worker, nodeid in ran:
        workers[nodeid.split("::")[0]].add(worker)
    assert set(workers) == set(files), done.stdout[-3000:]
    assert all(len(w) == 1 for w in workers.values()), dict(workers)
    if with_engine:
        (engine_worker,) = workers[ENGINE_FILE]
        on_it = [nodeid.split("::")[0] for worker, nodeid in ran if worker == engine_worker]
        first = on_it.index(ENGINE_FILE)
        assert set(on_it[first:]) == {ENGINE_FILE}, on_it

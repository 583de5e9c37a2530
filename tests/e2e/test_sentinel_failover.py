"""`asyncrlhf up configs/tiny.yaml` on a sentinel-managed Redis (a primary, a replica, three sentinels; no
embedded Redis): the primary is SIGKILLed mid-run (the reward service frozen meanwhile), the sentinels
promote the replica, every service reconnects to it by itself (no service restarts: `launch.restart` is off,
so a crash would stop the run), the run reaches total_steps and `asyncrlhf audit` is clean."""

import json
import os
import signal
import subprocess
import sys
import time

import pytest

from asyncrlhf.consumed import Kind, rows_of
from tests.e2e.test_up import ROOT, finish, up

pytestmark = pytest.mark.e2e
STEPS = 10
FAST = ["redis.reconnect_max_s=1", "redis.claim_idle_ms=2000", "redis.block_ms=200",
        "redis.sentinel.wait_timeout_ms=200", "generator.heartbeat_s=0.5", "generator.registry_ttl_s=6",
        "learner.push_timeout_s=5", f"learner.total_steps={STEPS}", "learner.checkpoint_every=4"]


def trained_steps(run_dir) -> int:
    return len(rows_of(run_dir, Kind.TRAINED))


@pytest.fixture
def launch(tmp_path):
    """`asyncrlhf up` in its own session; SIGTERMed if the test leaves it running (it then stops its services,
    which a SIGKILL of `up` alone would leave behind)."""
    procs = []

    def start(*overrides):
        procs.append(up(tmp_path, *overrides, start_new_session=True))
        return procs[-1]

    yield start
    for proc in procs:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGTERM)
            proc.wait(timeout=60)


def test_a_run_rides_out_the_primarys_sigkill_through_a_sentinel_failover(tmp_path, sentinel_cluster, launch):
    proc = launch(*sentinel_cluster.overrides(), *FAST)
    run = tmp_path / "run"
    deadline = time.monotonic() + 240
    while trained_steps(run) < 3:
        assert proc.poll() is None and time.monotonic() < deadline, proc.stdout.read()[-4000:]
        time.sleep(0.2)
    assert not (run / "redis").exists(), "`up` started an embedded Redis beside the sentinels' primary"
    # The reward service is frozen across the failover, so the learner (at most the credit bound, 2 steps,
    # ahead) is still mid-run when the primary dies, however fast the steps are.
    reward = [int(p) for p in subprocess.run(["pgrep", "-f", f"services.reward .*e2e-{tmp_path.name}"],
                                             capture_output=True, text=True).stdout.split()]
    assert reward, "no reward process found"
    for pid in reward:
        os.kill(pid, signal.SIGSTOP)
    old = sentinel_cluster.kill_primary()
    sentinel_cluster.wait_for_failover(old)
    assert trained_steps(run) < STEPS  # steps are left to train on the promoted replica
    for pid in reward:
        os.kill(pid, signal.SIGCONT)
    code, out = finish(proc, timeout=300)
    assert code == 0, out[-4000:]
    assert "Redis sentinels 127.0.0.1:" in out and "redis://" not in out
    summary = json.loads((run / "up_summary.json").read_text())
    assert summary["learner_version"] == STEPS + 1
    assert all(s["restarts"] == 0 for s in summary["services"].values()), summary["services"]
    learner_log = (run / "logs" / "learner.log").read_text()
    assert "Redis restarted or failed over (run id" in learner_log  # it checked Redis against its records
    assert "0 of 1 replicas acknowledged" in learner_log  # no replica is left after the failover: said so

    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    audit = subprocess.run([sys.executable, "-m", "asyncrlhf.cli", "audit", str(run), "--json"], cwd=ROOT,
                           env=env, capture_output=True, text=True)
    assert audit.returncode == 0, audit.stdout + audit.stderr
    verdict = json.loads(audit.stdout)
    assert (verdict["lost"], verdict["trained_twice"], verdict["updates_lost"]) == ([], [], [])
    assert verdict["trained"] == STEPS * 4  # configs/tiny.yaml: 4 groups per step

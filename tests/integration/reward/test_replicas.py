"""Two reward replicas as real processes (one per entry point); one is SIGKILLed holding a group mid-score.
Every group must come out of `scored` exactly once."""

import os
import signal
import socket
import subprocess
import sys
from pathlib import Path

import pytest
import requests

from asyncrlhf import metrics as names
from asyncrlhf.config import RedisConfig
from asyncrlhf.streams import REWARD_GROUP, ROLLOUTS, RunStreams
from tests.integration.reward.helpers import rollout, scored_groups, wait_for

pytestmark = pytest.mark.integration

REPO = Path(__file__).resolve().parents[3]
GROUPS = 60

# Slow enough that both replicas share the work; when the env var's file exists it marks itself stalled
# and hangs, so the test can SIGKILL it while it holds an unacked group.
RULE = """
import os, time
from asyncrlhf.rewards.rules import sentiment

def slow_sentiment(prompts, completions):
    stall = os.environ.get("STALL_FILE")
    if stall and os.path.exists(stall):
        open(stall + ".stalled", "w").close()
        time.sleep(3600)
    time.sleep(0.1)
    return sentiment(prompts, completions)
"""


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start_replica(command, config, port, log, env_extra=()):
    env = {**os.environ, "PYTHONPATH": str(REPO), "OMP_NUM_THREADS": "1", **dict(env_extra)}
    overrides = [f"reward.http_port={port}"]
    return subprocess.Popen(
        [*command, "--config", str(REPO / "configs/tiny.yaml"), "--config", str(config), *overrides],
        cwd=REPO,
        env=env,
        stdout=log,
        stderr=subprocess.STDOUT,
    )


def ready(port) -> bool:
    try:
        return requests.get(f"http://127.0.0.1:{port}/readyz", timeout=1).status_code == 200
    except requests.ConnectionError:
        return False


def test_two_replicas_one_killed_mid_batch_score_every_group_exactly_once(
    redis_url, redis_client, run_name, tmp_path
):
    (tmp_path / "slow.py").write_text(RULE)
    stall = tmp_path / "stall"
    config = tmp_path / "reward.yaml"
    config.write_text(
        f"run: {{name: {run_name}}}\n"
        f"redis: {{url: '{redis_url}', claim_idle_ms: 500, block_ms: 100}}\n"
        f"reward:\n  batch_size: 2\n"
        f"  scorers:\n    - {{kind: rule, name: '{tmp_path}/slow.py:slow_sentiment'}}\n"
    )
    streams = RunStreams(redis_client, run_name, RedisConfig())
    ports = free_port(), free_port()
    logs = [open(tmp_path / f"replica{i}.log", "wb") for i in range(2)]
    victim = start_replica(
        [sys.executable, "-m", "services.reward"], config, ports[0], logs[0], {"STALL_FILE": str(stall)}
    )
    survivor = start_replica(
        [str(Path(sys.executable).parent / "asyncrlhf"), "reward"], config, ports[1], logs[1]
    )
    try:
        wait_for(lambda: ready(ports[0]) and ready(ports[1]), 90, "both replicas ready", poll_s=0.2)
        streams.producer(ROLLOUTS).add_many([rollout(f"g{i:03d}") for i in range(GROUPS)])
        wait_for(
            lambda: len({g.scorer_id for g in scored_groups(streams)}) == 2,
            60,
            "both replicas to score groups",
            poll_s=0.1,
        )
        stall.touch()
        wait_for(lambda: Path(f"{stall}.stalled").exists(), 30, "the victim to stall mid-batch")
        victim.send_signal(signal.SIGKILL)
        victim.wait(timeout=10)
        pending = redis_client.xpending(streams.key(ROLLOUTS.name), REWARD_GROUP)
        held = {c["name"]: c["pending"] for c in pending["consumers"]}
        victim_name = next(n for n in held if n.decode().endswith(f"-{victim.pid}"))
        assert held[victim_name] >= 1, "the victim should die holding an unacked group"

        wait_for(lambda: len(scored_groups(streams)) >= GROUPS, 90, "every group scored", poll_s=0.2)
        wait_for(lambda: streams.stats(ROLLOUTS, REWARD_GROUP).pending == 0, 30, "nothing left pending")
        ids = [g.group_id for g in scored_groups(streams)]
        assert sorted(ids) == [f"g{i:03d}" for i in range(GROUPS)], "each group exactly once"
        assert all(
            len(g.samples) == 2 and all(s.HasField("reward") for s in g.samples)
            for g in scored_groups(streams)
        )
        metrics = requests.get(f"http://127.0.0.1:{ports[1]}/metrics", timeout=5).text
        assert names.REWARD_GROUPS_SCORED_TOTAL in metrics
        assert survivor.poll() is None, "the survivor should still be running"
    finally:
        for proc in (victim, survivor):
            if proc.poll() is None:
                proc.send_signal(signal.SIGTERM)
                try:
                    proc.wait(timeout=15)
                except subprocess.TimeoutExpired:
                    proc.kill()
        for log in logs:
            log.close()
    assert survivor.returncode == 0, (tmp_path / "replica1.log").read_text()[-3000:]

"""SIGTERM stops the learner promptly in every state: waiting for data that never comes, with Redis down,
and with a weight push in flight to a generator that never answers (writing a checkpoint when it can).
Each stop is bounded by `run.stop_timeout_s` (here 8 s); the test fails if the process outlives 30 s."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
import redis

from asyncrlhf.config import load_config
from asyncrlhf.redis_server import EmbeddedRedis
from asyncrlhf.registry import Registry
from asyncrlhf.service import STOPPED_BY_DEADLINE
from asyncrlhf.training.checkpoint import latest_version
from asyncrlhf.version import PolicyVersion

pytestmark = pytest.mark.integration
ROOT = Path(__file__).resolve().parents[3]
BOUND_S = 30


def learner(tmp_path, url, name, *extra):
    args = [f"redis.url={url}", f"run.name={name}", f"run.dir={tmp_path}/run", "redis.block_ms=100",
            "redis.reconnect_max_s=1", "run.stop_timeout_s=8", "learner.total_steps=100", *extra]
    log_path = tmp_path / "learner.log"
    env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"}
    command = [sys.executable, "-m", "services.learner", "--config", "configs/tiny.yaml", *args]
    proc = subprocess.Popen(command,
                            cwd=ROOT, env=env, stdout=log_path.open("w"), stderr=subprocess.STDOUT)
    return proc, log_path, load_config(["configs/tiny.yaml"], args)


def until(condition, proc, log_path, timeout=180):
    deadline = time.monotonic() + timeout
    while not condition():
        assert proc.poll() is None, log_path.read_text()[-3000:]
        assert time.monotonic() < deadline, log_path.read_text()[-3000:]
        time.sleep(0.1)


def stop(proc, log_path) -> int:
    proc.send_signal(signal.SIGTERM)
    try:
        return proc.wait(timeout=BOUND_S)
    except subprocess.TimeoutExpired:
        proc.kill()
        pytest.fail(f"the learner outlived SIGTERM by {BOUND_S} s:\n{log_path.read_text()[-3000:]}")


def test_sigterm_while_no_data_can_come_stops_and_checkpoints(tmp_path, redis_url, run_name):
    proc, log_path, cfg = learner(tmp_path, redis_url, run_name)  # no generator, no reward: nothing arrives
    until(lambda: "learner HTTP on" in log_path.read_text(), proc, log_path)
    time.sleep(1)  # in its read loop
    assert stop(proc, log_path) == 0, log_path.read_text()[-3000:]
    assert latest_version(cfg) == 1  # the checkpoint of the weights it holds


def test_sigterm_with_redis_down_stops_within_the_bound(tmp_path, run_name):
    server = EmbeddedRedis().start()
    try:
        proc, log_path, _ = learner(tmp_path, server.url, run_name)
        until(lambda: "learner HTTP on" in log_path.read_text(), proc, log_path)
        server.process.send_signal(signal.SIGKILL)  # Redis dies; the learner keeps reconnecting
        server.process.wait()
        time.sleep(2)
        code = stop(proc, log_path)
    finally:
        server.stop()
    assert code in (0, STOPPED_BY_DEADLINE), log_path.read_text()[-3000:]


def test_sigterm_with_a_push_in_flight_stops_within_the_bound(tmp_path, redis_url, run_name):
    # A generator whose process is stalled: the kernel accepts the connection and nothing ever answers.
    stalled = socket.socket()
    stalled.bind(("127.0.0.1", 0))
    stalled.listen(8)
    connected = threading.Event()

    def accept():
        conns = []
        while True:
            try:
                conns.append(stalled.accept()[0])
            except OSError:
                return
            connected.set()

    threading.Thread(target=accept, daemon=True).start()
    registry = Registry(redis.Redis.from_url(redis_url), run_name, ttl_s=600)
    registry.register("stalled", f"127.0.0.1:{stalled.getsockname()[1]}", PolicyVersion(0, 0))
    proc, log_path, _ = learner(tmp_path, redis_url, run_name, "learner.push_timeout_s=600")
    try:
        until(connected.is_set, proc, log_path)  # the first push is in flight
        time.sleep(1)
        code = stop(proc, log_path)
    finally:
        stalled.close()
    assert code in (0, STOPPED_BY_DEADLINE), log_path.read_text()[-3000:]

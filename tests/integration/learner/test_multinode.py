"""The learner past one node: two torchrun launches on this machine (two "nodes" of one rank each) meeting
at one static rendezvous (node ranks given, as deploy/k8s gives each pod its index; gloo) train to the same
weights as one node of two ranks, and the node without rank 0 answers health probes meanwhile."""

import json
import re
import subprocess
import sys
import time
import urllib.request

import pytest
import torch
from safetensors.torch import load_file

from asyncrlhf.config import load_config
from asyncrlhf.consumed import Kind
from asyncrlhf.redis_server import free_port
from asyncrlhf.training.checkpoint import HF, step_dir
from tests.integration.learner.actor import Actor
from tests.integration.learner.test_loop import consumed
from tests.integration.learner.test_processes import start, wait

pytestmark = pytest.mark.integration
RUN = [sys.executable, "-m", "torch.distributed.run"]
LEARNER = ["-m", "services.learner", "--config", "configs/tiny.yaml"]
FOLLOWER_URL = re.compile(r"learner HTTP on (http://\S+) \(rank 1 of 2, following rank 0\)")


def args(tmp_path, redis_url, name):
    return [f"redis.url={redis_url}", f"run.name={name}", f"run.dir={tmp_path}/{name}", "learner.lr=3e-3",
            "learner.groups_per_step=4", "learner.micro_batch_size=2", "learner.total_steps=2",
            "learner.checkpoint_every=100", "learner.max_staleness=0", "learner.deepspeed.zero_stage=2",
            "learner.http_port=0", "redis.block_ms=50"]


def train(tmp_path, redis_url, name, launches, while_held=None):
    """Run the learner as the given torchrun launches against a stand-in generator + reward; the weights
    of its final checkpoint and the groups it trained. `while_held(procs)` runs before the stand-in serves
    any group: until it returns, the learner cannot take a step."""
    overrides = args(tmp_path, redis_url, name)
    cfg = load_config(["configs/tiny.yaml"], overrides)
    actor = Actor(cfg, redis_url)  # registered and receiving pushes; no groups until started
    procs = []
    try:
        procs = [(start([*RUN, *launch, *LEARNER, *overrides], tmp_path / f"{name}-{i}.log"),
                  tmp_path / f"{name}-{i}.log") for i, launch in enumerate(launches)]
        if while_held:
            while_held(procs)
        actor.start()
        for proc, log in procs:
            wait(proc, 300, log)
    finally:
        stop(procs)
        actor.close()
    trained = [r["group_ids"] for r in consumed(cfg) if r["kind"] == Kind.TRAINED]
    return load_file(str(step_dir(cfg.run.path, 3) / HF / "model.safetensors")), trained, procs


def stop(procs):
    """Left running only when the test failed: SIGTERM (torchrun passes it to its workers), then SIGKILL."""
    for proc, _ in procs:
        if proc.poll() is None:
            proc.terminate()
    for proc, _ in procs:
        try:
            proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            proc.kill()


def logged(pattern, proc, log, timeout=240) -> re.Match:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if found := pattern.search(log.read_text()):
            return found
        if proc.poll() is not None:
            pytest.fail(f"exited ({proc.returncode}) before logging {pattern.pattern}:\n"
                        f"{log.read_text()[-3000:]}")
        time.sleep(0.2)
    pytest.fail(f"not logged within {timeout} s: {pattern.pattern}\n{log.read_text()[-3000:]}")


def get(url) -> tuple[int, str]:
    with urllib.request.urlopen(url, timeout=10) as reply:
        return reply.status, reply.read().decode()


def test_two_nodes_of_one_rank_equal_one_node_of_two(tmp_path, redis_url, run_name):
    port = str(free_port())
    nodes = [["--nnodes", "2", "--nproc_per_node", "1", "--node_rank", str(rank),
              "--master_addr", "127.0.0.1", "--master_port", port] for rank in (0, 1)]
    answers = {}

    def follower_answers(procs):
        url = logged(FOLLOWER_URL, *procs[1]).group(1)
        answers.update({route: get(url + route) for route in ("/healthz", "/readyz", "/metrics")})

    two_nodes, trained_two, procs = train(tmp_path, redis_url, f"{run_name}-2n", nodes, follower_answers)
    one_node, trained_one, _ = train(tmp_path, redis_url, f"{run_name}-1n",
                                     [["--standalone", "--nproc_per_node", "2"]])
    assert trained_two == trained_one and len(trained_one) == 2
    # node rank 0 holds global rank 0 (static rendezvous): it alone does the I/O and logs the steps
    logs = [log.read_text() for _, log in procs]
    assert "step 1 version 2" in logs[0] and "step 1 version 2" not in logs[1]
    for name, tensor in two_nodes.items():
        torch.testing.assert_close(tensor, one_node[name], atol=0, rtol=0, msg=name)
    # the other node's first process answered the probes while rank 0 waited for its first batch
    status, health = answers["/healthz"]
    assert status == 200 and json.loads(health) == {"status": "ok", "service": "learner"}
    status, ready = answers["/readyz"]
    assert status == 200 and json.loads(ready)["reason"] == "rank 1 of 2, following rank 0"
    status, metrics = answers["/metrics"]
    assert status == 200 and "asyncrlhf_learner" not in metrics  # rank 0 alone exports the learner's series

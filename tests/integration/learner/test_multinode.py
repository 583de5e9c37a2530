"""The learner past one node: two torchrun launches on this machine (two "nodes" of one rank each) meeting
at one c10d rendezvous endpoint (gloo) train to the same weights as one node of two ranks."""

import sys

import pytest
import torch
from safetensors.torch import load_file

from asyncrlhf.config import load_config
from asyncrlhf.redis_server import free_port
from asyncrlhf.training.checkpoint import HF, step_dir
from tests.integration.learner.actor import Actor
from tests.integration.learner.test_loop import consumed
from tests.integration.learner.test_processes import start, wait

pytestmark = pytest.mark.integration
RUN = [sys.executable, "-m", "torch.distributed.run"]
LEARNER = ["-m", "services.learner", "--config", "configs/tiny.yaml"]


def args(tmp_path, redis_url, name):
    return [f"redis.url={redis_url}", f"run.name={name}", f"run.dir={tmp_path}/{name}", "learner.lr=3e-3",
            "learner.groups_per_step=4", "learner.micro_batch_size=2", "learner.total_steps=2",
            "learner.checkpoint_every=100", "learner.max_staleness=0", "learner.deepspeed.zero_stage=2",
            "redis.block_ms=50"]


def train(tmp_path, redis_url, name, launches):
    """Run the learner as the given torchrun launches against a stand-in generator + reward; the weights
    of its final checkpoint and the groups it trained."""
    overrides = args(tmp_path, redis_url, name)
    cfg = load_config(["configs/tiny.yaml"], overrides)
    actor = Actor(cfg, redis_url).start()
    try:
        procs = [(start([*RUN, *launch, *LEARNER, *overrides], tmp_path / f"{name}-{i}.log"),
                  tmp_path / f"{name}-{i}.log") for i, launch in enumerate(launches)]
        for proc, log in procs:
            wait(proc, 300, log)
    finally:
        actor.close()
    trained = [r["group_ids"] for r in consumed(cfg) if r["kind"] == "trained"]
    return load_file(str(step_dir(cfg.run.path, 3) / HF / "model.safetensors")), trained, procs


def test_two_nodes_of_one_rank_equal_one_node_of_two(tmp_path, redis_url, run_name):
    endpoint = f"127.0.0.1:{free_port()}"
    nodes = [["--nnodes", "2", "--nproc_per_node", "1", "--node_rank", str(rank), "--rdzv_backend",
              "c10d", "--rdzv_endpoint", endpoint, "--rdzv_id", run_name,
              "--rdzv_conf", f"is_host={rank == 0}".lower()] for rank in (0, 1)]
    two_nodes, trained_two, procs = train(tmp_path, redis_url, f"{run_name}-2n", nodes)
    one_node, trained_one, _ = train(tmp_path, redis_url, f"{run_name}-1n",
                                     [["--standalone", "--nproc_per_node", "2"]])
    assert trained_two == trained_one and len(trained_one) == 2
    # rank 0 alone does the I/O: exactly one of the two nodes (the one c10d made rank 0) logged the steps
    logs = [log.read_text() for _, log in procs]
    assert sum("step 1 version 2" in text for text in logs) == 1
    for name, tensor in two_nodes.items():
        torch.testing.assert_close(tensor, one_node[name], atol=0, rtol=0, msg=name)

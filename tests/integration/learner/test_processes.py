"""The learner as a real process: two ranks under torchrun, and a SIGKILL after a checkpoint."""

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import redis
import torch
from safetensors.torch import load_file

from asyncrlhf.audit import audit_run, format_audit
from asyncrlhf.config import load_config
from asyncrlhf.consumed import Kind
from asyncrlhf.models import ReferencePolicy, load_policy
from asyncrlhf.training import engine
from asyncrlhf.training.batch import TrainGroup
from asyncrlhf.training.checkpoint import HF, latest_version, read_state, step_dir
from asyncrlhf.training.objectives import make_objective
from asyncrlhf.training.policies import LearnerModels
from asyncrlhf.training.trainer import Trainer
from tests.integration.learner.actor import Actor, scored_group
from tests.integration.learner.test_loop import consumed

pytestmark = pytest.mark.integration
ROOT = Path(__file__).resolve().parents[3]


def start(args, log_path, env_extra=None):
    env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1", **(env_extra or {})}
    return subprocess.Popen(args, cwd=ROOT, env=env, stdout=log_path.open("w"), stderr=subprocess.STDOUT)


def wait(proc, timeout, log_path):
    try:
        rc = proc.wait(timeout=timeout)
    except subprocess.TimeoutExpired:
        proc.kill()
        pytest.fail(f"timed out; log:\n{log_path.read_text()[-3000:]}")
    assert rc == 0, log_path.read_text()[-3000:]


def sync_weights(cfg, rows, prompts):
    """The same groups through one in-process rank (twice the accumulation of each of two ranks)."""
    engine.init_distributed()
    policy = engine.initialize(load_policy(cfg.model), cfg.learner)
    reference = ReferencePolicy(load_policy(cfg.model))
    trainer = Trainer(cfg, LearnerModels(policy, reference, None), objective=make_objective(cfg), pad_id=0)
    for step, row in enumerate(rows, start=1):
        groups = [TrainGroup(scored_group(prompts[gid], step)) for gid in row["group_ids"]]
        trainer.train_step(groups, step_seed=cfg.run.seed + step)
    return policy.module.state_dict()


@pytest.mark.parametrize("packing", [False, True], ids=["padded", "packed"])
def test_two_ranks_zero2_equal_one_rank_with_twice_the_accumulation(tmp_path, redis_url, run_name, packing):
    """Packed, the ranks take items balanced by tokens (not two groups each), and still sum to one rank's
    update."""
    args = [f"learner.packing={str(packing).lower()}", "learner.pack_tokens=48", f"redis.url={redis_url}",
            f"run.name={run_name}", f"run.dir={tmp_path}/run", "learner.lr=3e-3",
            "learner.groups_per_step=4", "learner.micro_batch_size=2", "learner.total_steps=3",
            "learner.checkpoint_every=100", "learner.max_staleness=0", "learner.deepspeed.zero_stage=2",
            "redis.block_ms=50"]
    cfg = load_config(["configs/tiny.yaml"], args)
    actor = Actor(cfg, redis_url).start()
    log = tmp_path / "torchrun.log"
    try:
        proc = start([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2",
                      "-m", "services.learner", "--config", "configs/tiny.yaml", *args], log)
        wait(proc, 300, log)
    finally:
        actor.close()
    rows = [r for r in consumed(cfg) if r["kind"] == Kind.TRAINED]
    assert len(rows) == 3
    two_ranks = load_file(str(step_dir(cfg.run.path, 4) / HF / "model.safetensors"))
    one_rank = sync_weights(cfg, rows, actor.prompts)
    # Tolerance: the two ranks all-reduce partial gradient sums, one rank adds micro-batches in sequence;
    # fp32 addition in another order differs in the last bits, which Adam's normalisation can amplify to
    # ~1e-5 of a weight after a few steps at lr 3e-3.
    for name, tensor in two_ranks.items():
        torch.testing.assert_close(tensor, one_rank[name], atol=1e-4, rtol=1e-3, msg=name)


def test_sigkill_after_a_checkpoint_resumes_there_and_trains_no_group_twice(tmp_path, redis_url, run_name):
    args = [f"redis.url={redis_url}", f"run.name={run_name}", f"run.dir={tmp_path}/run", "learner.lr=3e-3",
            "learner.groups_per_step=2", "learner.micro_batch_size=2", "learner.total_steps=6",
            "learner.checkpoint_every=2", "learner.max_staleness=1", "redis.block_ms=50"]
    cfg = load_config(["configs/tiny.yaml"], args)
    actor = Actor(cfg, redis_url).start()
    cmd = [sys.executable, "-m", "services.learner", "--config", "configs/tiny.yaml", *args]
    try:
        first_log = tmp_path / "first.log"
        proc = start(cmd, first_log)
        deadline = time.monotonic() + 180
        while latest_version(cfg) != 3:
            assert proc.poll() is None, first_log.read_text()[-3000:]
            assert time.monotonic() < deadline, first_log.read_text()[-3000:]
            time.sleep(0.05)
        proc.send_signal(signal.SIGKILL)
        proc.wait()
        killed_at = max(r["version"] for r in consumed(cfg) if r["kind"] == Kind.TRAINED)
        second_log = tmp_path / "second.log"
        wait(start(cmd, second_log), 180, second_log)
    finally:
        actor.close()
    second = second_log.read_text()
    assert "resumed from" in second and "at version 3 (lineage 1's checkpoint)" in second
    rows = consumed(cfg)
    lost_updates = {g for r in rows if r["kind"] == Kind.TRAINED and r["lineage"] == 1 and r["version"] > 3
                    for g in r["group_ids"]}  # trained after the checkpoint the second start resumed from
    retrained = {g for r in rows if r["kind"] == Kind.TRAINED and r["lineage"] == 2 for g in r["group_ids"]}
    assert lost_updates <= retrained, "a group whose update died with the learner was not trained again"
    if lost_updates:
        assert any(r["kind"] == Kind.REQUEUED and lost_updates <= set(r["group_ids"]) for r in rows)
    audit = audit_run(cfg, redis.Redis.from_url(redis_url))
    assert not audit.trained_twice and not audit.updates_lost and not audit.lost, format_audit(audit, "t")
    assert [e.lineage for e in audit.lineages] == [1, 2] and audit.lineages[1].from_version == 3
    versions = [r["version"] for r in rows if r["kind"] == Kind.TRAINED]
    assert versions[-1] == 7 and killed_at >= 3
    state = read_state(step_dir(cfg.run.path, 7))
    assert (state.version, state.lineage) == (7, 2)

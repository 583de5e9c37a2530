"""The learner service against real Redis and real gRPC: the schedule, staleness and the sync invariant."""

import threading

import pytest
import torch

from asyncrlhf import metrics as names
from asyncrlhf.config import load_config
from asyncrlhf.consumed import Kind, read_rows
from asyncrlhf.inbox.ids import group_index
from asyncrlhf.models import ReferencePolicy, load_policy
from asyncrlhf.streams import GENERATOR_GROUP, PROMPTS, RunStreams
from asyncrlhf.training import engine
from asyncrlhf.training.batch import TrainGroup
from asyncrlhf.training.objectives import make_objective
from asyncrlhf.training.policies import LearnerModels
from asyncrlhf.training.trainer import Trainer
from services.learner.loop import Learner
from tests.integration.learner.actor import Actor, scored_group

pytestmark = pytest.mark.integration


def learner_config(tmp_path, redis_url, run_name, *overrides):
    return load_config(["configs/tiny.yaml"], [
        f"redis.url={redis_url}", f"run.name={run_name}", f"run.dir={tmp_path}/run", "learner.lr=3e-3",
        "learner.groups_per_step=3", "learner.micro_batch_size=2", "learner.total_steps=4",
        "learner.checkpoint_every=100", "redis.block_ms=50", *overrides])


def consumed(cfg):
    return read_rows(cfg.run.path)


def run_learner(cfg, redis_url, **actor_kwargs):
    actor = Actor(cfg, redis_url, **actor_kwargs).start()
    try:
        learner = Learner(cfg)
        done = threading.Event()
        threading.Timer(120, lambda: done.is_set() or learner.stop.set()).start()  # bound the test
        learner.run()
        done.set()
    finally:
        actor.close()
    return learner, actor


@pytest.mark.parametrize("algorithm", ["online_dpo", "rloo"])
def test_max_staleness_zero_equals_the_synchronous_algorithm(tmp_path, redis_url, run_name, algorithm):
    cfg = learner_config(tmp_path, redis_url, run_name, "learner.max_staleness=0",
                         f"learner.algorithm={algorithm}", "learner.kl.coef=0.01")
    learner, actor = run_learner(cfg, redis_url)
    rows = [r for r in consumed(cfg) if r["kind"] == Kind.TRAINED]
    assert len(rows) == 4 and all(s == 0 for r in rows for s in r["staleness"])  # on-policy by construction
    # so every trained token is fresh: each one's recorded log-prob was measured against the learner's
    sample = learner.metrics.registry.get_sample_value
    assert sample(names.LEARNER_MISMATCH_TOKENS_TOTAL) == sample(names.LEARNER_TOKENS_TOTAL) > 0
    assert sample(names.LEARNER_MISMATCH_ABS_LOG_RATIO, {"stat": "max"}) > 0  # the actor records -2.0 each

    # the synchronous path: the same groups, in the same order, straight into a fresh Trainer
    engine.init_distributed()
    policy = engine.initialize(load_policy(cfg.model), cfg.learner)
    reference = ReferencePolicy(load_policy(cfg.model))
    trainer = Trainer(cfg, LearnerModels(policy, reference, None), objective=make_objective(cfg), pad_id=0)
    for step, row in enumerate(rows, start=1):
        groups = [TrainGroup(scored_group(actor.prompts[gid], step)) for gid in row["group_ids"]]
        trainer.train_step(groups, step_seed=cfg.run.seed + step)
    # Bit-exact: both paths run the same kernels on the same tensors in the same order on CPU in fp32.
    async_weights, sync_weights = learner.policy.module.state_dict(), policy.module.state_dict()
    for (name, a), (_, b) in zip(async_weights.items(), sync_weights.items(), strict=True):
        assert torch.equal(a, b), name


def test_in_flight_groups_never_exceed_the_bound(tmp_path, redis_url, run_name):
    cfg = learner_config(tmp_path, redis_url, run_name, "learner.max_staleness=1")
    learner, actor = run_learner(cfg, redis_url)
    streams = RunStreams(learner.duties.client, cfg.run.name)
    enqueued = learner.duties.inbox.feed.cursor
    trained = sum(len(r["group_ids"]) for r in consumed(cfg))
    assert enqueued - trained <= (1 + 1) * 3  # (max_staleness + 1) x groups_per_step
    assert max(s for r in consumed(cfg) if r["kind"] == Kind.TRAINED for s in r["staleness"]) <= 1
    assert streams.stats(PROMPTS, GENERATOR_GROUP).length <= 6
    assert learner.metrics.step_to_serve._value.get() > 0  # a step reached the actor's receiver, timed


def test_groups_beyond_max_staleness_are_dropped_and_counted(tmp_path, redis_url, run_name):
    cfg = learner_config(tmp_path, redis_url, run_name, "learner.max_staleness=0",
                         "learner.stale_policy=drop")

    def stale(gid: str) -> int:  # every 4th group claims an older version
        return 1 if group_index(gid) % 4 == 1 else 0

    learner, actor = run_learner(cfg, redis_url, version_offset=stale)
    rows = consumed(cfg)
    dropped = [g for r in rows if r["kind"] == Kind.DROPPED for g in r["group_ids"]]
    trained = [g for r in rows if r["kind"] == Kind.TRAINED for g in r["group_ids"]]
    assert dropped and all(stale(g) for g in dropped)
    assert not set(dropped) & set(trained)
    assert len(trained) == 4 * 3  # the run still completes: dropped groups give their credits back
    assert learner.metrics.stale.labels("dropped")._value.get() == len(dropped)
    assert learner.state.version == 5
    # the lengths generated beside those trained: the dropped groups' samples count only as generated
    def samples(stage: str, what: str) -> float:
        return learner.metrics.registry.get_sample_value(f"{names.LEARNER_SAMPLE_TOKENS}_{what}",
                                                         {"stage": stage})

    k = cfg.generator.samples_per_prompt
    assert samples("trained", "count") == k * len(trained)
    assert samples("generated", "count") >= k * (len(trained) + len(dropped))
    assert 0 < samples("trained", "sum") < samples("generated", "sum")


def test_trackers_get_every_step_with_loss_kl_reward_staleness_throughput_lr(tmp_path, redis_url, run_name):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    cfg = learner_config(tmp_path, redis_url, run_name, "learner.max_staleness=1",
                         "run.trackers=[tensorboard]")
    run_learner(cfg, redis_url)
    events = EventAccumulator(str(cfg.run.path / "tensorboard" / "learner"),
                              size_guidance={"scalars": 0}).Reload()
    trained = [r for r in consumed(cfg) if r["kind"] == Kind.TRAINED]
    for tag in ("loss", "kl", "reward_mean", "staleness_mean", "samples_per_s", "tokens_per_s", "lr"):
        assert [e.step for e in events.Scalars(tag)] == [1, 2, 3, 4], tag
    assert [e.value for e in events.Scalars("lr")] == pytest.approx([3e-3] * 4)
    staleness = [sum(r["staleness"]) / len(r["staleness"]) for r in trained]
    assert [e.value for e in events.Scalars("staleness_mean")] == pytest.approx(staleness)

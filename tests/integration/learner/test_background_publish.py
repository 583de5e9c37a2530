"""Background publish and per-token staleness against real Redis and real gRPC: the learner pushes each
version on a thread while it collects and trains the next step, and frees the next window's credits only when
that push completes, so with `max_staleness: 1` no trained token (each judged by its own sampling version) is
more than one version old, by construction: nothing is dropped as stale."""

import threading

import pytest

from asyncrlhf import metrics as names
from asyncrlhf.consumed import Kind
from services.learner.loop import Learner
from tests.integration.learner.actor import Actor
from tests.integration.learner.test_loop import consumed, learner_config, run_learner

pytestmark = pytest.mark.integration


def test_with_max_staleness_one_no_trained_token_is_more_than_one_version_old(tmp_path, redis_url, run_name):
    cfg = learner_config(tmp_path, redis_url, run_name, "learner.max_staleness=1", "learner.total_steps=6")
    assert cfg.learner.background_publish  # the default
    learner, actor = run_learner(cfg, redis_url, spanning=True)
    trained = [r for r in consumed(cfg) if r["kind"] == Kind.TRAINED]
    assert len(trained) == 6
    ages, spanned = [], 0
    for row in trained:
        trained_at = row["version"] - 1  # the version the step trained (its update made row["version"])
        for gid, staleness in zip(row["group_ids"], row["staleness"], strict=True):
            versions = actor.token_versions[gid]  # what the stand-in generator tagged each token with
            oldest = min(v for sample in versions for v in sample)
            assert staleness == trained_at - oldest, (gid, versions)  # judged on the oldest token
            spanned += any(len(set(sample)) > 1 for sample in versions)
            ages += [trained_at - v for sample in versions for v in sample]
    assert max(ages) <= 1, ages
    assert spanned, "no trained group spanned a push: the test would not tell per-token staleness apart"
    assert not [r for r in consumed(cfg) if r["kind"] == Kind.DROPPED]  # the bound held by construction
    # the per-token histogram saw every trained token, none older than one version
    sample = learner.metrics.registry.get_sample_value
    count = sample(f"{names.LEARNER_TOKEN_STALENESS_VERSIONS}_count")
    assert count == len(ages)
    assert sample(f"{names.LEARNER_TOKEN_STALENESS_VERSIONS}_bucket", {"le": "1.0"}) == count
    assert sample(f"{names.LEARNER_TOKEN_STALENESS_VERSIONS}_bucket", {"le": "0.0"}) == ages.count(0)
    assert sample(names.LEARNER_WAITING_FRACTION, {"on": "data"}) > 0
    assert sample(names.LEARNER_WAITING_FRACTION, {"on": "push"}) is not None


def test_synchronous_publish_keeps_the_same_bound(tmp_path, redis_url, run_name):
    cfg = learner_config(tmp_path, redis_url, run_name, "learner.max_staleness=1", "learner.total_steps=4",
                         "learner.background_publish=false")
    learner, actor = run_learner(cfg, redis_url, spanning=True)
    trained = [r for r in consumed(cfg) if r["kind"] == Kind.TRAINED]
    assert len(trained) == 4
    ages = [r["version"] - 1 - v for r in trained for gid in r["group_ids"]
            for sample in actor.token_versions[gid] for v in sample]
    assert max(ages) <= 1
    assert learner.metrics.push_wait._value.get() > 0  # every step waited for its push


def test_a_push_that_completes_while_the_learner_trains_frees_the_next_prompts_at_once(
        tmp_path, redis_url, run_name):
    """Each background push is held at the stand-in generator until the learner trains the next step, so it
    completes mid-step (on the demo a push completed as the step's last group arrived, after the collect's
    last tick). The step's credits must be freed then, not after the training: once the push of version s
    completed, 2 + (s - 1) windows of prompts are enqueued (each trained step's refilled), while training."""
    cfg = learner_config(tmp_path, redis_url, run_name, "learner.max_staleness=1", "learner.total_steps=3")
    g = cfg.learner.groups_per_step
    actor = Actor(cfg, redis_url).start()
    applying = actor.receiver.target.lock  # held: a push waits before it is applied
    enqueued: dict[int, int] = {}  # learner version before a step -> prompts enqueued once its push is done
    bound = threading.Timer(120, lambda: learner.stop.set())  # bound the test
    try:
        learner = Learner(cfg)
        train = learner.trainer.train_step

        def train_with_the_push_landing_meanwhile(groups, step_seed=0):
            version = learner.state.version
            if version > 1:  # the push of `version` is in flight, held at the generator: it lands now
                applying.release()
            stats = train(groups, step_seed)
            learner.weights.wait()  # the push completed (the learner's next call would wait for it too)
            enqueued[version] = learner.duties.inbox.feed.cursor
            if version < cfg.learner.total_steps:  # hold the next step's push until that step trains
                applying.acquire()
            return stats

        learner.trainer.train_step = train_with_the_push_landing_meanwhile
        bound.start()
        learner.run()
    finally:
        bound.cancel()
        actor.close()
    assert enqueued == {s: (2 + s - 1) * g for s in (1, 2, 3)}

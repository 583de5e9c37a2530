"""Background publish and per-token staleness against real Redis and real gRPC: the learner pushes each
version on a thread while it collects and trains the next step, and frees the next window's credits only when
that push completes, so with `max_staleness: 1` no trained token (each judged by its own sampling version) is
more than one version old, by construction: nothing is dropped as stale."""

import pytest

from asyncrlhf import metrics as names
from asyncrlhf.consumed import Kind
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

"""What a learner start (or a Redis restart) repairs, on a real Redis: groups trained after the resumed
checkpoint are enqueued again (their update was lost), entries that Redis lost are re-created from the
consumed log and the cursor, and the credits follow from the log."""

from __future__ import annotations

import pytest
import redis

from asyncrlhf.models import load_tokenizer
from asyncrlhf.redis_server import EmbeddedRedis
from asyncrlhf.streams import GENERATOR_GROUP, ID_FIELD, PROMPTS, RunStreams, connect
from asyncrlhf.training.checkpoint import LearnerState
from services.learner.metrics import LearnerMetrics
from services.learner.schedule import Schedule, StepBatch
from tests.integration.learner.test_loop import consumed, learner_config

pytestmark = pytest.mark.integration


def ids_in(client, streams, name):
    return [f[ID_FIELD].decode() for _, f in client.xrange(streams.key(name))]


def schedule(cfg, client, state, resumed):
    streams = RunStreams(client, cfg.run.name, cfg.redis)
    return Schedule(cfg, client, streams, load_tokenizer(cfg.model), state, LearnerMetrics(), resumed=resumed)


def test_a_start_requeues_lost_updates_and_lost_entries_once(tmp_path, redis_url, run_name):
    cfg = learner_config(tmp_path, redis_url, run_name, "learner.groups_per_step=4")
    client = redis.Redis.from_url(redis_url)
    streams = RunStreams(client, cfg.run.name, cfg.redis)
    first = schedule(cfg, client, LearnerState(), resumed=False)
    assert first.lineage == 1 and first.feed.fill(1) == 8  # (max_staleness + 1) x groups_per_step
    # Lineage 1 trains g0 g1 (version 2, checkpointed) and g2 g3 (version 3), then dies; their prompt entries
    # were consumed. Redis then loses the entry of g4 (appendfsync everysec) but keeps g5..g7.
    first.consumed.append("trained", 2, ["g00000000", "g00000001"])
    first.consumed.append("trained", 3, ["g00000002", "g00000003"])
    entries = {f[ID_FIELD].decode(): entry for entry, f in client.xrange(streams.key(PROMPTS.name))}
    client.xdel(streams.key(PROMPTS.name), *(entries[f"g{i:08d}"] for i in range(5)))
    client.zadd(streams.seen_key(PROMPTS, GENERATOR_GROUP), {"g00000002": 1.0})  # the generator saw it

    second = schedule(cfg, client, LearnerState(version=2, lineage=1, cursor=8), resumed=True)
    assert second.lineage == 2
    requeued = {r["reason"]: r["group_ids"] for r in consumed(cfg) if r["kind"] == "requeued"}
    assert requeued == {"update_lost": ["g00000002", "g00000003"], "entry_lost": ["g00000004"]}
    assert sorted(ids_in(client, streams, PROMPTS.name)) == [f"g{i:08d}" for i in range(2, 8)]
    assert client.zscore(streams.seen_key(PROMPTS, GENERATOR_GROUP), "g00000002") is None  # processed again
    assert second.credits.in_flight == 6 and second.known_finished == 2  # g0 g1 ended; 6 on their way
    assert second.retrain == {"g00000002", "g00000003"}

    # Another start at once: nothing is missing any more, so nothing is enqueued twice.
    third = schedule(cfg, client, LearnerState(version=2, lineage=2, cursor=8), resumed=True)
    assert third.lineage == 3
    assert [r for r in consumed(cfg) if r["kind"] == "requeued" and r["lineage"] == 3] == []  # nothing twice
    assert len(ids_in(client, streams, PROMPTS.name)) == 6


def test_after_a_redis_sigkill_and_restart_on_its_aof_the_learner_recreates_lost_entries(tmp_path, run_name):
    server = EmbeddedRedis(tmp_path / "redis", appendfsync="always").start()
    try:
        cfg = learner_config(tmp_path, server.url, run_name, "learner.groups_per_step=4",
                             "redis.reconnect_max_s=0.5")
        client = connect(cfg.redis)
        streams = RunStreams(client, cfg.run.name, cfg.redis)
        live = schedule(cfg, client, LearnerState(), resumed=False)
        live.feed.fill(1)
        live.consumed.append("trained", 2, ["g00000000"])
        entries = {f[ID_FIELD].decode(): entry for entry, f in client.xrange(streams.key(PROMPTS.name))}
        client.xdel(streams.key(PROMPTS.name), entries["g00000000"], entries["g00000001"])
        # g1's entry is gone as if the last second before the crash was not on disk (everysec); with
        # appendfsync always everything else survives the SIGKILL.
        server.kill()
        server.start()
        live._redis_checked = 0.0
        live._after_redis_restart(1, StepBatch())
        requeued = [r for r in consumed(cfg) if r["kind"] == "requeued"]
        assert [(r["reason"], r["group_ids"]) for r in requeued] == [("entry_lost", ["g00000001"])]
        assert sorted(ids_in(client, streams, PROMPTS.name)) == [f"g{i:08d}" for i in range(1, 8)]
        assert live.credits.in_flight == 7
    finally:
        server.stop()

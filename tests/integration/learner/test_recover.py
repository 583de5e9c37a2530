"""What a learner start (or a Redis restart) repairs, on a real Redis: groups trained after the resumed
checkpoint are enqueued again (their update was lost), entries that Redis lost are re-created from the
consumed log and the cursor, and the credits follow from the log."""

from __future__ import annotations

import time

import pytest
import redis

from asyncrlhf.consumed import Kind, rows_of
from asyncrlhf.inbox.ids import group_id
from asyncrlhf.inbox.inbox import Inbox
from asyncrlhf.inbox.prompts import prompt_set
from asyncrlhf.inbox.recovery import REDIS_CHECK_S
from asyncrlhf.models import load_tokenizer
from asyncrlhf.redis_server import EmbeddedRedis
from asyncrlhf.streams import GENERATOR_GROUP, ID_FIELD, PROMPTS, RunStreams, connect
from asyncrlhf.training.checkpoint import LearnerState
from services.learner.metrics import LearnerMetrics
from tests.integration.learner.test_loop import learner_config

pytestmark = pytest.mark.integration


def ids_in(client, streams, name):
    return [f[ID_FIELD].decode() for _, f in client.xrange(streams.key(name))]


def inbox(cfg, client, state, resumed):
    streams = RunStreams(client, cfg.run.name, cfg.redis)
    prompts = prompt_set(cfg, load_tokenizer(cfg.model))
    return Inbox(cfg, streams, prompts, state, LearnerMetrics(), resumed=resumed)


def requeued(cfg):
    return rows_of(cfg.run.path, Kind.REQUEUED)


def ids(n, start=0):
    return [group_id(i) for i in range(start, n)]


def test_a_start_requeues_lost_updates_and_lost_entries_once(tmp_path, redis_url, run_name):
    cfg = learner_config(tmp_path, redis_url, run_name, "learner.groups_per_step=4")
    client = redis.Redis.from_url(redis_url)
    streams = RunStreams(client, cfg.run.name, cfg.redis)
    first = inbox(cfg, client, LearnerState(), resumed=False)
    assert first.lineage == 1 and first.feed.fill(1) == 8  # (max_staleness + 1) x groups_per_step
    # Lineage 1 trains g0 g1 (version 2, checkpointed) and g2 g3 (version 3), then dies; their prompt entries
    # were consumed. Redis then loses the entry of g4 (appendfsync everysec) but keeps g5..g7.
    first.consumed.append(Kind.TRAINED, 2, ["g00000000", "g00000001"])
    first.consumed.append(Kind.TRAINED, 3, ["g00000002", "g00000003"])
    entries = {f[ID_FIELD].decode(): entry for entry, f in client.xrange(streams.key(PROMPTS.name))}
    client.xdel(streams.key(PROMPTS.name), *(entries[g] for g in ids(5)))
    client.zadd(streams.seen_key(PROMPTS, GENERATOR_GROUP), {"g00000002": 1.0})  # the generator saw it

    second = inbox(cfg, client, LearnerState(version=2, lineage=1, cursor=8), resumed=True)
    assert second.lineage == 2
    requeued_by = {r["reason"]: r["group_ids"] for r in requeued(cfg)}
    assert requeued_by == {"update_lost": ["g00000002", "g00000003"], "entry_lost": ["g00000004"]}
    assert sorted(ids_in(client, streams, PROMPTS.name)) == ids(8, start=2)
    assert client.zscore(streams.seen_key(PROMPTS, GENERATOR_GROUP), "g00000002") is None  # processed again
    assert second.in_flight == 6 and second.known_finished == 2  # g0 g1 ended; 6 on their way
    assert second.recovery.retrain == {"g00000002", "g00000003"}

    # Another start at once: nothing is missing any more, so nothing is enqueued twice.
    third = inbox(cfg, client, LearnerState(version=2, lineage=2, cursor=8), resumed=True)
    assert third.lineage == 3
    assert [r for r in requeued(cfg) if r["lineage"] == 3] == []  # nothing twice
    assert len(ids_in(client, streams, PROMPTS.name)) == 6


def test_after_a_redis_sigkill_and_restart_on_its_aof_the_learner_recreates_lost_entries(tmp_path, run_name):
    server = EmbeddedRedis(tmp_path / "redis", appendfsync="always").start()
    try:
        cfg = learner_config(tmp_path, server.url, run_name, "learner.groups_per_step=4",
                             "redis.reconnect_max_s=0.5")
        client = connect(cfg.redis)
        streams = RunStreams(client, cfg.run.name, cfg.redis)
        live = inbox(cfg, client, LearnerState(), resumed=False)
        live.feed.fill(1)
        live.consumed.append(Kind.TRAINED, 2, ["g00000000"])
        entries = {f[ID_FIELD].decode(): entry for entry, f in client.xrange(streams.key(PROMPTS.name))}
        client.xdel(streams.key(PROMPTS.name), entries["g00000000"], entries["g00000001"])
        # g1's entry is gone as if the last second before the crash was not on disk (everysec); with
        # appendfsync always everything else survives the SIGKILL.
        server.kill()
        server.start()
        time.sleep(REDIS_CHECK_S)
        live.tick(1, lambda: None)  # notices the restart, repairs, then enqueues what the credits allow
        assert [(r["reason"], r["group_ids"]) for r in requeued(cfg)] == [("entry_lost", ["g00000001"])]
        # g0 ended (trained): its credit went to g8
        assert sorted(ids_in(client, streams, PROMPTS.name)) == ids(9, start=1)
        assert live.in_flight == 8
    finally:
        server.stop()

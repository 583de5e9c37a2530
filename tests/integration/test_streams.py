"""Redis Streams transport against a real redis-server: consumer groups, re-claim, dead-letter, de-dup."""

from __future__ import annotations

import collections
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from asyncrlhf._proto.rollout_pb2 import PromptGroup, RolloutGroup
from asyncrlhf.config import RedisConfig
from asyncrlhf.redis_server import EmbeddedRedis
from asyncrlhf.streams import (
    GENERATOR_GROUP,
    ID_FIELD,
    LEARNER_FINISHED,
    LEARNER_GROUP,
    PROMPTS,
    ROLLOUTS,
    RunStreams,
    connect,
)
from asyncrlhf.streams.consumer import hold

pytestmark = pytest.mark.integration

REPO = Path(__file__).resolve().parents[2]
FAST = RedisConfig(claim_idle_ms=200, block_ms=50, max_deliveries=2)


@pytest.fixture
def streams(redis_client, run_name) -> RunStreams:
    return RunStreams(redis_client, run_name, FAST)


def prompts(n: int, start: int = 0) -> list[PromptGroup]:
    return [PromptGroup(group_id=f"g{i:04d}", prompt=f"prompt {i}", prompt_token_ids=[1, 2, i], k=4)
            for i in range(start, start + n)]


def drain(consumer, count: int = 100) -> list:
    out = []
    while batch := consumer.read(count, block_ms=0):
        out += batch
    return out


def test_round_trip_preserves_the_message(streams):
    sent = prompts(3)
    streams.producer(PROMPTS).add_many(sent)
    got = streams.consumer(PROMPTS, GENERATOR_GROUP, "c0").read(10)
    assert [d.message for d in got] == sent
    assert [d.identity for d in got] == ["g0000", "g0001", "g0002"]
    assert all(d.deliveries == 1 for d in got)


def test_producer_refuses_the_wrong_message_type(streams):
    with pytest.raises(TypeError, match="carries PromptGroup"):
        streams.producer(PROMPTS).add(RolloutGroup(group_id="x"))


def test_consumers_share_the_work_and_ack_deletes(streams):
    streams.producer(PROMPTS).add_many(prompts(10))
    a, b = (streams.consumer(PROMPTS, GENERATOR_GROUP, name) for name in ("a", "b"))
    got_a, got_b = a.read(6), b.read(6)
    assert len(got_a) == 6 and len(got_b) == 4
    assert {d.identity for d in got_a}.isdisjoint(d.identity for d in got_b)
    assert streams.stats(PROMPTS, GENERATOR_GROUP).pending == 10
    a.ack(got_a)
    b.ack(got_b)
    stats = streams.stats(PROMPTS, GENERATOR_GROUP)
    assert (stats.length, stats.pending, stats.lag, stats.consumers) == (0, 0, 0, 2)


def test_stats_report_depth_lag_and_pending(streams):
    assert streams.stats(PROMPTS, GENERATOR_GROUP).length == 0  # no stream yet: zeros, no error
    streams.producer(PROMPTS).add_many(prompts(7))
    consumer = streams.consumer(PROMPTS, GENERATOR_GROUP, "c0")
    consumer.read(3)
    stats = streams.stats(PROMPTS, GENERATOR_GROUP)
    assert (stats.length, stats.lag, stats.pending) == (7, 4, 3)


def test_malformed_entry_is_dead_lettered_with_reason(streams, redis_client):
    key = streams.key(PROMPTS.name)
    redis_client.xadd(key, {"id": "bad-1", "pb": b"\xff\xff\xff\xff"})
    redis_client.xadd(key, {"pb": PromptGroup(group_id="no-id").SerializeToString()})
    streams.producer(PROMPTS).add(prompts(1)[0])
    consumer = streams.consumer(PROMPTS, GENERATOR_GROUP, "c0")
    assert [d.identity for d in consumer.read(10)] == ["g0000"]
    dead = streams.dead_letters()
    assert [d.identity for d in dead] == ["bad-1", ""]
    assert "cannot decode PromptGroup" in dead[0].reason and dead[0].payload == b"\xff\xff\xff\xff"
    assert "lacks the `id`" in dead[1].reason
    assert dead[0].stream == PROMPTS.name and dead[0].consumer == "c0"
    assert streams.dead_letters(after=dead[0].entry_id) == dead[1:]  # a reader resumes after the last it saw
    assert streams.stats(PROMPTS, GENERATOR_GROUP).pending == 1  # the bad ones were acked


def test_entry_failing_too_often_is_dead_lettered(streams):
    streams.producer(PROMPTS).add(prompts(1)[0])
    consumer = streams.consumer(PROMPTS, GENERATOR_GROUP, "c0")
    attempts = []
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline and not streams.dead_letters():
        for delivery in consumer.read(1, block_ms=50):
            attempts.append(delivery.deliveries)
            consumer.fail(delivery, "scorer exploded")
    assert attempts == [1, 2]  # max_deliveries=2
    dead = streams.dead_letters()
    assert len(dead) == 1 and "failed 2 times; last error: scorer exploded" in dead[0].reason
    assert streams.stats(PROMPTS, GENERATOR_GROUP).length == 0


def test_entry_never_acked_is_dead_lettered_after_max_deliveries(streams):
    streams.producer(PROMPTS).add(prompts(1)[0])
    consumers = [streams.consumer(PROMPTS, GENERATOR_GROUP, f"c{i}") for i in range(3)]
    deliveries = []
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline and not streams.dead_letters():
        for consumer in consumers:  # each one takes it and "dies" without acking
            deliveries += [d.deliveries for d in consumer.read(1, block_ms=0)]
        time.sleep(0.05)
    assert deliveries == [1, 2]
    assert "delivered 3 times without an ack" in streams.dead_letters()[0].reason


def test_a_held_entry_is_not_reclaimed_nor_counted_as_redelivered(streams):
    streams.producer(PROMPTS).add(prompts(1)[0])
    holder, other = (streams.consumer(PROMPTS, GENERATOR_GROUP, name) for name in ("holder", "other"))
    [held] = holder.read(1, block_ms=0)
    stolen = []
    deadline = time.monotonic() + 1.2  # six times claim_idle_ms=200
    while time.monotonic() < deadline:
        hold(holder, [held])
        stolen += other.read(1, block_ms=0)
        time.sleep(0.05)
    assert stolen == [] and not streams.dead_letters()
    time.sleep(0.3)  # no longer held: idle past claim_idle_ms, so the other consumer re-claims it
    [claimed] = other.read(1, block_ms=0)
    assert claimed.identity == held.identity and claimed.deliveries == 2  # hold did not count a delivery


def test_duplicate_group_is_processed_once(streams):
    producer = streams.producer(PROMPTS)
    rollouts = streams.producer(ROLLOUTS)
    consumer = streams.consumer(PROMPTS, GENERATOR_GROUP, "c0")
    producer.add_many(prompts(2))
    first = consumer.read(10)
    assert consumer.ack(first, [RolloutGroup(group_id=d.identity) for d in first], rollouts) == 2
    producer.add_many(prompts(3))  # g0000 and g0001 again, plus g0002
    second = drain(consumer)
    assert [d.identity for d in second] == ["g0002"]
    assert consumer.duplicates_skipped == 2
    assert consumer.seen("g0000") and not consumer.seen("g9999")


def test_ack_never_emits_an_output_twice(streams, redis_client):
    """Two copies of one group delivered to two consumers before either acks: one output downstream."""
    streams.producer(PROMPTS).add_many(prompts(1) + prompts(1))
    rollouts = streams.producer(ROLLOUTS)
    a, b = (streams.consumer(PROMPTS, GENERATOR_GROUP, name) for name in ("a", "b"))
    got_a, got_b = a.read(1), b.read(1)
    assert got_a[0].identity == got_b[0].identity == "g0000"
    assert a.ack(got_a, [RolloutGroup(group_id="g0000", generator_id="a")], rollouts) == 1
    assert b.ack(got_b, [RolloutGroup(group_id="g0000", generator_id="b")], rollouts) == 0
    assert redis_client.xlen(streams.key(ROLLOUTS.name)) == 1
    assert streams.stats(PROMPTS, GENERATOR_GROUP).pending == 0


def test_seen_set_survives_a_consumer_restart(streams):
    streams.producer(PROMPTS).add_many(prompts(2))
    first = streams.consumer(PROMPTS, LEARNER_GROUP, "learner-0")
    first.ack(first.read(10))
    streams.producer(PROMPTS).add_many(prompts(2))
    restarted = streams.consumer(PROMPTS, LEARNER_GROUP, "learner-0")
    assert drain(restarted) == []


def test_prompt_credits_bound_in_flight_and_survive_restart(streams):
    credits = streams.credits(limit=5)
    assert credits.acquire(3) == 3
    assert credits.acquire(3) == 2  # only 2 left under the bound
    assert credits.acquire(1) == 0
    restarted = streams.credits(limit=5)  # a new learner process reads the same count
    assert restarted.in_flight == 5 and restarted.available == 0
    assert restarted.release(4) == 1
    assert restarted.release(10) == 0  # never below zero
    assert credits.available == 5


def test_a_release_retried_under_its_token_frees_credits_once(streams, redis_client):
    """The client re-sends a command whose reply was lost (Redis restarting): the bound must still hold."""
    credits = streams.credits(limit=8)
    finished = streams.key(LEARNER_FINISHED)
    assert credits.acquire(8) == 8
    assert credits.release(4, "trained:g00000000", finished_key=finished) == 4
    assert credits.release(4, "trained:g00000000", finished_key=finished) == 4  # the retry: no effect
    assert int(redis_client.get(finished)) == 4
    assert credits.acquire(8) == 4  # not 8: in flight stays within the bound
    assert credits.release(4, "trained:g00000004", finished_key=finished) == 4
    assert int(redis_client.get(finished)) == 8


def test_consumer_killed_mid_batch_loses_nothing_and_doubles_nothing(streams, redis_client, redis_url):
    """Two consumer processes; one is SIGKILLed holding a batch it never acked. Every group reaches
    `rollouts` exactly once."""
    n = 60
    streams.producer(PROMPTS).add_many(prompts(n))
    worker = [sys.executable, "-m", "tests.integration.streams_worker", redis_url, streams.run]
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    victim = subprocess.Popen([*worker, "victim", "--stall-on-batch", "2"], cwd=REPO, env=env)
    survivor = None
    try:
        stalled_key = streams.key("stalled:victim")
        deadline = time.monotonic() + 60
        while redis_client.get(stalled_key) is None and time.monotonic() < deadline:
            time.sleep(0.02)
        held = int(redis_client.get(stalled_key) or 0)
        assert held > 0, "the victim never stalled mid-batch"
        survivor = subprocess.Popen([*worker, "survivor"], cwd=REPO, env=env)
        while redis_client.xlen(streams.key(ROLLOUTS.name)) <= held and time.monotonic() < deadline:
            time.sleep(0.02)  # both consumers are live in the group now
        victim.send_signal(signal.SIGKILL)
        victim.wait(10)
        while redis_client.xlen(streams.key(ROLLOUTS.name)) < n and time.monotonic() < deadline:
            time.sleep(0.05)
        time.sleep(0.5)  # let any double write show up
    finally:
        for proc in (victim, survivor):
            if proc is not None:
                proc.kill()
                proc.wait(10)
    entries = redis_client.xrange(streams.key(ROLLOUTS.name))
    ids = collections.Counter(fields[ID_FIELD].decode() for _, fields in entries)
    assert sorted(ids) == [p.group_id for p in prompts(n)], "lost groups"
    assert max(ids.values()) == 1, f"groups written twice: {[g for g, c in ids.items() if c > 1]}"
    by = collections.Counter(RolloutGroup.FromString(f[b"pb"]).generator_id for _, f in entries)
    assert by["survivor"] >= held  # the survivor re-claimed the victim's batch
    stats = streams.stats(PROMPTS, GENERATOR_GROUP)
    assert (stats.length, stats.pending) == (0, 0)


def test_consumer_rides_out_a_redis_restart(tmp_path):
    """Redis is killed and restarted on the same port from its AOF: the client reconnects with back-off and
    the consumer carries on where it was."""
    cfg = RedisConfig(claim_idle_ms=200, block_ms=50, reconnect_max_s=0.2)
    with EmbeddedRedis(tmp_path / "redis") as server:
        streams = RunStreams(connect(cfg, server.url), "restart", cfg)
        streams.producer(PROMPTS).add_many(prompts(4))
        consumer = streams.consumer(PROMPTS, GENERATOR_GROUP, "c0")
        consumer.ack(consumer.read(2))
        server.stop()  # clean stop: the AOF is flushed
        server.start()
        rest = drain(consumer)
        assert [d.identity for d in rest] == ["g0002", "g0003"]
        assert consumer.seen("g0000")


def test_consumer_recreates_its_group_after_redis_lost_everything():
    cfg = RedisConfig(claim_idle_ms=200, block_ms=50, reconnect_max_s=0.2)
    with EmbeddedRedis() as server:
        streams = RunStreams(connect(cfg, server.url), "amnesia", cfg)
        consumer = streams.consumer(PROMPTS, GENERATOR_GROUP, "c0")
        server.kill()
        server.start()  # same port, no AOF: the group is gone
        assert consumer.read(1, block_ms=0) == []
        streams.producer(PROMPTS).add(prompts(1)[0])
        assert [d.identity for d in consumer.read(1)] == ["g0000"]


def test_dead_letter_now_acks_and_records_the_payload(streams):
    streams.producer(PROMPTS).add(prompts(1)[0])
    consumer = streams.consumer(PROMPTS, GENERATOR_GROUP, "c0")
    (delivery,) = consumer.read(1)
    consumer.dead_letter(delivery, "prompt is empty after truncation")
    (dead,) = streams.dead_letters()
    assert dead.reason == "prompt is empty after truncation"
    assert PromptGroup.FromString(dead.payload) == delivery.message
    assert streams.stats(PROMPTS, GENERATOR_GROUP).pending == 0

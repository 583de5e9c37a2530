"""A learner run rides out a Redis restart in every staleness mode: the restart is noticed by the inbox's
tick and Redis is checked against the consumed log, so an entry the restart lost is enqueued again and the
run finishes with every group accounted for."""

from __future__ import annotations

import threading
import time

import pytest

from asyncrlhf.audit import audit_run
from asyncrlhf.consumed import Kind, read_rows
from asyncrlhf.inbox.inbox import Inbox
from asyncrlhf.inbox.prompts import prompt_set
from asyncrlhf.inbox.recovery import REDIS_CHECK_S
from asyncrlhf.models import load_tokenizer
from asyncrlhf.redis_server import EmbeddedRedis
from asyncrlhf.streams import FEED_CURSOR, ID_FIELD, PROMPTS, SCORED, RunStreams, connect
from asyncrlhf.training.checkpoint import LearnerState
from services.learner.loop import Learner
from services.learner.metrics import LearnerMetrics
from tests.integration.learner.actor import Actor
from tests.integration.learner.groups import scored_groups
from tests.integration.learner.test_loop import learner_config

pytestmark = pytest.mark.integration
BOUND_S = 90  # the test's bound on the learner's run


def until(condition, what: str, timeout_s: float = 30) -> None:
    deadline = time.monotonic() + timeout_s
    while not condition():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.05)


def requeued(cfg) -> list[str]:
    return [g for r in read_rows(cfg.run.path) if r["kind"] == Kind.REQUEUED for g in r["group_ids"]]


@pytest.mark.parametrize("mode", ["exact", "bound"])
def test_a_run_finishes_after_a_redis_restart_that_lost_an_entry(tmp_path, run_name, mode):
    server = EmbeddedRedis(tmp_path / "redis", appendfsync="always").start()
    gate = threading.Event()  # the stand-in generator answers nothing until Redis has restarted
    actor = learner = None
    try:
        cfg = learner_config(tmp_path, server.url, run_name, f"learner.staleness_mode={mode}",
                             "learner.max_staleness=1", "learner.total_steps=3", "redis.reconnect_max_s=0.5")
        client = connect(cfg.redis)
        streams = RunStreams(client, cfg.run.name, cfg.redis)
        actor = Actor(cfg, server.url, answers=lambda version: gate.is_set()).start()
        learner = Learner(cfg)
        runner = threading.Thread(target=learner.run, daemon=True)
        runner.start()
        until(lambda: int(client.get(streams.key(FEED_CURSOR)) or 0) == 6, "the first 6 prompts")
        # g1's entry is gone as if the last second before a crash was not on disk (appendfsync everysec)
        entries = {f[ID_FIELD].decode(): e for e, f in client.xrange(streams.key(PROMPTS.name))}
        client.xdel(streams.key(PROMPTS.name), entries["g00000001"])
        server.kill()
        server.start()
        until(lambda: requeued(cfg) == ["g00000001"], "the learner to enqueue the lost g00000001 again")
        gate.set()
        runner.join(BOUND_S)
        assert learner.state.steps == 3
        actor.close()  # nothing moves while the audit reads the streams
        audit = audit_run(cfg, client)
        assert audit.ok and audit.lost == [] and audit.trained == 9, audit.summary()
    finally:
        if learner is not None:
            learner.stop.set()
        if actor is not None:
            actor.close()
        server.stop()


def test_a_restart_while_a_trained_step_awaits_its_push_keeps_the_bound(tmp_path, run_name):
    # exact, N = 1, 2 groups a step: 4 credits. A trained step's credits are freed only after its push, and
    # before the push the inbox waits for the open window's groups (settle). A restart noticed then recounts
    # the trained groups as in flight until released, so nothing is enqueued beyond the bound.
    server = EmbeddedRedis(tmp_path / "redis", appendfsync="always").start()
    try:
        cfg = learner_config(tmp_path, server.url, run_name, "learner.staleness_mode=exact",
                             "learner.max_staleness=1", "learner.groups_per_step=2",
                             "redis.reconnect_max_s=0.5")
        streams = RunStreams(connect(cfg.redis), cfg.run.name, cfg.redis)
        prompts = prompt_set(cfg, load_tokenizer(cfg.model))
        inbox = Inbox(cfg, streams, prompts, LearnerState(), LearnerMetrics())
        stop, scored, k = threading.Event(), streams.producer(SCORED), cfg.generator.samples_per_prompt

        def step(version: int):
            batch = inbox.collect(version, stop, lambda: None)
            assert batch is not None
            inbox.trained(batch, version + 1)
            return batch

        inbox.tick(1, lambda: None)  # g0..g3 under version 1
        scored.add_many(scored_groups(4, k, version=1))
        first = step(1)  # g0 g1: its own window, complete
        inbox.settle(first, 1, stop, lambda: None)
        inbox.release(2)  # g4 g5 under version 2
        second = step(2)  # g2 g3 (version 1) while version 2's window generates
        assert second.ids() == ["g00000002", "g00000003"]
        server.kill()
        server.start()
        time.sleep(REDIS_CHECK_S)
        scored.add_many(scored_groups(2, k, version=2, start=4))
        inbox.settle(second, 2, stop, lambda: None)  # its tick repairs the restart, then g4 g5 arrive
        inbox.release(3)
        assert inbox.feed.cursor == 8 and inbox.in_flight == 4 and inbox.finished == 4
    finally:
        server.stop()

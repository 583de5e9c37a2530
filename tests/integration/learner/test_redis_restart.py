"""A learner run rides out a Redis restart in every staleness mode: the restart is noticed by the inbox's
tick and Redis is checked against the consumed log, so an entry the restart lost is enqueued again and the
run finishes with every group accounted for."""

from __future__ import annotations

import threading
import time

import pytest

from asyncrlhf.audit import audit_run
from asyncrlhf.consumed import read_rows
from asyncrlhf.redis_server import EmbeddedRedis
from asyncrlhf.streams import FEED_CURSOR, ID_FIELD, PROMPTS, RunStreams, connect
from services.learner.loop import Learner
from tests.integration.learner.actor import Actor
from tests.integration.learner.test_loop import learner_config

pytestmark = pytest.mark.integration
BOUND_S = 90  # the test's bound on the learner's run


def until(condition, what: str, timeout_s: float = 30) -> None:
    deadline = time.monotonic() + timeout_s
    while not condition():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.05)


def requeued(cfg) -> list[str]:
    return [g for r in read_rows(cfg.run.path) if r["kind"] == "requeued" for g in r["group_ids"]]


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

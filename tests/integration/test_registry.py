"""Generator registry against a real redis-server: heartbeat keeps a member live, silence expires it."""

from __future__ import annotations

import time

import pytest

from asyncrlhf.registry import Heartbeat, Registry
from asyncrlhf.version import PolicyVersion

pytestmark = pytest.mark.integration


def wait_until(predicate, timeout_s: float = 5.0) -> bool:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if predicate():
            return True
        time.sleep(0.05)
    return False


def test_register_lists_members_sorted_with_their_version(redis_client, run_name):
    registry = Registry(redis_client, run_name, ttl_s=10)
    registry.register("gen-1", "10.0.0.2:5000", PolicyVersion(1, 3))
    registry.register("gen-0", "10.0.0.1:5000", PolicyVersion(2, 2))
    registry.register("gen-1", "10.0.0.2:5000", PolicyVersion(1, 4))  # a heartbeat updates in place
    live = registry.live()
    assert [(m.id, m.address, m.version) for m in live] == [("gen-0", "10.0.0.1:5000", PolicyVersion(2, 2)),
                                                             ("gen-1", "10.0.0.2:5000", PolicyVersion(1, 4))]
    assert all(m.updated_at > 0 for m in live)


def test_silent_member_disappears_after_the_ttl(redis_client, run_name):
    registry = Registry(redis_client, run_name, ttl_s=0.3)
    registry.register("gen-0", "127.0.0.1:1", PolicyVersion(0, 0))
    assert [m.id for m in registry.live()] == ["gen-0"]
    assert wait_until(lambda: registry.live() == [])
    assert redis_client.smembers(registry.index_key) == set()  # pruned from the index too


def test_heartbeat_keeps_a_member_live_and_reports_its_version(redis_client, run_name):
    registry = Registry(redis_client, run_name, ttl_s=1.0)
    version = [PolicyVersion(0, 0)]
    with Heartbeat(registry, "gen-0", "127.0.0.1:1", lambda: version[0], period_s=0.1):
        version[0] = PolicyVersion(2, 7)
        assert wait_until(lambda: [m.version for m in registry.live()] == [PolicyVersion(2, 7)])
        time.sleep(2.0)  # twice the TTL: only the heartbeat keeps it there
        assert [m.id for m in registry.live()] == ["gen-0"]
    assert registry.live() == []  # stop() deregisters at once


def test_runs_do_not_see_each_others_members(redis_client, run_name):
    Registry(redis_client, run_name).register("gen-0", "127.0.0.1:1", PolicyVersion(0, 0))
    assert Registry(redis_client, run_name + "-other").live() == []

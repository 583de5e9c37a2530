"""asyncrlhf/streams/connection.py with `redis.sentinel`, against a real primary, replica and three sentinels:
a client follows a failover by itself (also one blocked in XREADGROUP when the primary dies), a write the
replica acknowledged (WAIT) survives the primary's SIGKILL, and a WAIT that gets fewer replicas than asked
says so."""

import logging
import threading

import pytest

from asyncrlhf.config import RedisConfig, SentinelConfig
from asyncrlhf.streams import ReplicaWait, connect
from tests.sentinels import MASTER

pytestmark = pytest.mark.integration


def blocked_readers(node) -> int:
    return sum(c["cmd"] == "xreadgroup" and "b" in c["flags"] for c in node.client().client_list())


def test_clients_follow_a_failover_and_keep_what_the_replica_acknowledged(sentinel_cluster, caplog):
    cfg = RedisConfig(sentinel=SentinelConfig(addresses=sentinel_cluster.addresses, master=MASTER,
                                              wait_timeout_ms=300), reconnect_max_s=0.5)
    writer, reader = connect(cfg), connect(cfg)
    wait = ReplicaWait(writer, cfg, "test:wait_mark")
    writer.xgroup_create("test:stream", "readers", id="$", mkstream=True)
    for i in range(50):
        writer.xadd("test:log", {"i": i})
    assert wait("the entries") == 1  # the replica holds all 50 before the primary dies

    received: list = []
    done = threading.Event()

    def read() -> None:  # what every service's consumer does: XREADGROUP BLOCK, again and again
        while not received and not done.is_set():
            received.extend(reader.xreadgroup("readers", "r", {"test:stream": ">"}, count=1, block=200))

    thread = threading.Thread(target=read, daemon=True)
    thread.start()
    while not blocked_readers(sentinel_cluster.primary):
        assert thread.is_alive()
    old = sentinel_cluster.kill_primary()
    writer.xadd("test:log", {"i": 50})  # retried through the sentinels until the replica is promoted
    new = sentinel_cluster.wait_for_failover(old)
    writer.xadd("test:stream", {"after": "failover"})
    thread.join(timeout=60)
    done.set()
    assert received and received[0][1][0][1] == {b"after": b"failover"}, "the blocked reader never came back"
    assert reader.connection_pool.get_master_address()[1] == new.port != old.port
    assert [int(f[b"i"]) for _, f in writer.xrange("test:log")] == list(range(51))

    with caplog.at_level(logging.WARNING, logger="asyncrlhf.streams"):
        assert wait("after the failover") == 0  # the old primary is dead: no replica is left
    assert "after the failover: 0 of 1 replicas acknowledged within 300 ms" in caplog.text
    assert wait.short == 1


def test_no_sentinels_means_no_wait(redis_url):
    cfg = RedisConfig(url=redis_url)
    assert ReplicaWait(connect(cfg), cfg, "test:wait_mark")("anything") is None

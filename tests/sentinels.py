"""A sentinel-managed Redis for tests: a primary, one replica and three sentinels (quorum 2), each a real
`redis-server` (the sentinels run it with `--sentinel`) on a free loopback port, with its files in a
directory of its own. `SentinelCluster.start()` returns once the replica is in sync and every sentinel knows
the replica and the other two sentinels, so that killing the primary leads to a failover."""

from __future__ import annotations

import subprocess
import time
from dataclasses import dataclass
from pathlib import Path

import redis
from redis.backoff import NoBackoff
from redis.retry import Retry

from asyncrlhf.redis_server import find_redis_server, free_port

MASTER = "asyncrlhf"
SENTINELS = 3
QUORUM = 2


@dataclass
class Node:
    name: str
    port: int
    args: list[str]
    dir: Path
    process: subprocess.Popen | None = None

    def start(self) -> Node:
        self.dir.mkdir(parents=True, exist_ok=True)
        log = (self.dir / "out.log").open("ab")
        self.process = subprocess.Popen([find_redis_server(), *self.args], cwd=self.dir, stdout=log,
                                        stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                        start_new_session=True)
        return self

    def client(self) -> redis.Redis:
        return redis.Redis(port=self.port, socket_timeout=2, retry=Retry(NoBackoff(), 0))

    def kill(self) -> None:
        if self.process and self.process.poll() is None:
            self.process.kill()
            self.process.wait()

    def stop(self) -> None:
        if self.process and self.process.poll() is None:
            self.process.terminate()
            try:
                self.process.wait(10)
            except subprocess.TimeoutExpired:
                self.kill()

    def tail(self) -> str:
        path = self.dir / "out.log"
        return path.read_text(errors="replace")[-2000:] if path.exists() else "(no log)"


def _server(name: str, root: Path, *extra: str) -> Node:
    port = free_port()
    args = ["--port", str(port), "--bind", "127.0.0.1", "--save", "", "--appendonly", "yes",
            "--appendfsync", "everysec", "--dir", str(root / name), *extra]
    return Node(name, port, args, root / name)


def _sentinel(i: int, root: Path, primary_port: int, down_after_ms: int) -> Node:
    port, directory = free_port(), root / f"sentinel-{i}"
    directory.mkdir(parents=True, exist_ok=True)
    conf = directory / "sentinel.conf"  # a sentinel rewrites its config file: each has its own
    conf.write_text("\n".join([
        f"port {port}", "bind 127.0.0.1", f"dir {directory}",
        f"sentinel monitor {MASTER} 127.0.0.1 {primary_port} {QUORUM}",
        f"sentinel down-after-milliseconds {MASTER} {down_after_ms}",
        f"sentinel failover-timeout {MASTER} 10000",
        f"sentinel parallel-syncs {MASTER} 1",
    ]) + "\n")
    return Node(f"sentinel-{i}", port, [str(conf), "--sentinel"], directory)


class SentinelCluster:
    def __init__(self, root: Path, down_after_ms: int = 1000):
        self.root = root
        self.primary = _server("primary", root)
        self.replica = _server("replica", root, "--replicaof", "127.0.0.1", str(self.primary.port))
        self.sentinels = [_sentinel(i, root, self.primary.port, down_after_ms) for i in range(SENTINELS)]

    @property
    def nodes(self) -> list[Node]:
        return [self.primary, self.replica, *self.sentinels]

    @property
    def addresses(self) -> list[str]:
        """The sentinels as `redis.sentinel.addresses` takes them."""
        return [f"127.0.0.1:{s.port}" for s in self.sentinels]

    def overrides(self) -> list[str]:
        """Config overrides that point a run at this cluster."""
        return [f"redis.sentinel.addresses=[{','.join(self.addresses)}]", f"redis.sentinel.master={MASTER}"]

    def start(self, timeout_s: float = 60.0) -> SentinelCluster:
        for node in self.nodes:
            node.start()
        self._wait(self._ready, timeout_s, "the replica in sync and every sentinel seeing the whole cluster")
        return self

    def stop(self) -> None:
        for node in self.nodes:
            node.stop()

    def primary_port(self) -> int | None:
        """The primary's port as a majority of the live sentinels name it (None while they disagree)."""
        named = []
        for sentinel in self.sentinels:
            try:
                found = sentinel.client().sentinel_get_master_addr_by_name(MASTER)
            except redis.RedisError:
                continue
            named.append(int(found[1]) if found else None)
        best = max(set(named), key=named.count, default=None)
        return best if named.count(best) >= QUORUM else None

    def kill_primary(self) -> Node:
        """SIGKILL the node the sentinels name as primary; returns it."""
        port = self.primary_port()
        node = next(n for n in (self.primary, self.replica) if n.port == port)
        node.kill()
        return node

    def wait_for_failover(self, old: Node, timeout_s: float = 60.0) -> Node:
        """The node promoted in place of `old`, once the sentinels name it and it says it is a primary."""
        def promoted() -> bool:
            port = self.primary_port()
            if port is None or port == old.port:
                return False
            return self._node(port).client().info("replication")["role"] == "master"

        self._wait(promoted, timeout_s, f"a failover away from {old.name}")
        return self._node(self.primary_port())

    def _node(self, port: int | None) -> Node:
        return next(n for n in (self.primary, self.replica) if n.port == port)

    def _ready(self) -> bool:
        if self.replica.client().info("replication").get("master_link_status") != "up":
            return False
        for sentinel in self.sentinels:
            state = sentinel.client().sentinel_master(MASTER)
            if int(state["num-other-sentinels"]) < SENTINELS - 1 or int(state["num-slaves"]) < 1:
                return False
        return True

    def _wait(self, done, timeout_s: float, what: str) -> None:
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            try:
                if done():
                    return
            except redis.RedisError:
                pass
            time.sleep(0.2)
        logs = "\n".join(f"--- {n.name}\n{n.tail()}" for n in self.nodes)
        raise TimeoutError(f"no {what} within {timeout_s:g} s:\n{logs}")

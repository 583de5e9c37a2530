"""Generator registry: who is alive, where its WeightSync server listens, and which version it serves.

Each generator keeps a Redis hash `asyncrlhf:<run>:generators:<id>` (id, address, the `PolicyVersion` it
serves as `version` and `lineage`, updated_at) alive with a heartbeat (the hash expires after `ttl_s`
without one) and adds its id to the set `asyncrlhf:<run>:generators`. The learner
lists the live members before every push, and pushes at once to a member whose version is behind (a replica
that joined late). A member that stops heart-beating disappears after the TTL; its id is pruned lazily.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable
from dataclasses import dataclass

import redis

from asyncrlhf.streams import GENERATOR_REGISTRY, run_key
from asyncrlhf.version import PolicyVersion

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class Member:
    id: str
    address: str  # host:port of its WeightSync server
    version: PolicyVersion  # the policy version it serves
    updated_at: float  # Unix time of its last heartbeat


class Registry:
    def __init__(self, client: redis.Redis, run: str, ttl_s: float = 10.0, name: str = GENERATOR_REGISTRY):
        self.client, self.ttl_ms = client, max(1, int(ttl_s * 1000))
        self.index_key = run_key(run, name)

    def member_key(self, member_id: str) -> str:
        return f"{self.index_key}:{member_id}"

    def register(self, member_id: str, address: str, version: PolicyVersion) -> None:
        """Announce (or refresh) a member; it stays live for `ttl_s` after the last call."""
        key = self.member_key(member_id)
        now = self.client.time()
        pipe = self.client.pipeline(transaction=True)
        pipe.hset(key, mapping={"id": member_id, "address": address, "version": version.step,
                                "lineage": version.lineage, "updated_at": now[0] + now[1] / 1e6})
        pipe.pexpire(key, self.ttl_ms)
        pipe.sadd(self.index_key, member_id)
        pipe.execute()

    def deregister(self, member_id: str) -> None:
        pipe = self.client.pipeline(transaction=True)
        pipe.delete(self.member_key(member_id))
        pipe.srem(self.index_key, member_id)
        pipe.execute()

    def live(self) -> list[Member]:
        """The live members, sorted by id; expired ones are pruned from the index."""
        # redis-py's stub says bytes | str; without decode_responses SMEMBERS returns bytes
        ids = sorted(i.decode() for i in self.client.smembers(self.index_key))  # type: ignore[union-attr]
        pipe = self.client.pipeline(transaction=False)
        for member_id in ids:
            pipe.hgetall(self.member_key(member_id))
        members, gone = [], []
        for member_id, fields in zip(ids, pipe.execute(), strict=True):
            if not fields:
                gone.append(member_id)
                continue
            version = PolicyVersion(int(fields.get(b"lineage", 0)), int(fields[b"version"]))
            members.append(Member(member_id, fields[b"address"].decode(), version,
                                  float(fields[b"updated_at"])))
        if gone:
            self.client.srem(self.index_key, *gone)
        return members


class Heartbeat:
    """Re-registers a member every `period_s` from a daemon thread, with the version `version()` returns;
    Redis errors are logged and retried on the next beat. Deregisters on `stop()`."""

    def __init__(self, registry: Registry, member_id: str, address: str,
                 version: Callable[[], PolicyVersion], period_s: float = 2.0):
        self.registry, self.member_id, self.address, self.version = registry, member_id, address, version
        self.period_s = period_s
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name=f"heartbeat-{member_id}", daemon=True)

    def start(self) -> Heartbeat:
        self.beat()
        self._thread.start()
        return self

    def beat(self) -> None:
        self.registry.register(self.member_id, self.address, self.version())

    def stop(self, deregister: bool = True) -> None:
        self._stop.set()
        if self._thread.is_alive():
            self._thread.join()
        if deregister:
            try:
                self.registry.deregister(self.member_id)
            except redis.RedisError as err:
                log.warning("could not deregister %s: %s", self.member_id, err)

    def __enter__(self) -> Heartbeat:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()

    def _run(self) -> None:
        while not self._stop.wait(self.period_s):
            try:
                self.beat()
            except redis.RedisError as err:
                log.warning("heartbeat of %s failed (will retry): %s", self.member_id, err)

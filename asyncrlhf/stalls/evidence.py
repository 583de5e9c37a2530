"""What Redis shows of a run, read for a stall diagnosis: the streams' backlogs, each generator's last
registry heartbeat, the entries each replica holds (delivered, not acked) with its idle time, and how far
the learner has read the scored stream.

Read with a client that gives up within seconds (`asyncrlhf.streams.connect(..., timeout_s=...)`): a Redis
that does not answer is itself the evidence, and whoever asks must not hang with the services.
"""

from __future__ import annotations

import time
from collections.abc import Callable

import redis

from asyncrlhf.registry import Member, Registry
from asyncrlhf.stalls.diagnosis import Flow, Replica
from asyncrlhf.streams import (
    GENERATOR_GROUP,
    LEARNER_GROUP,
    PROMPTS,
    REWARD_GROUP,
    ROLLOUTS,
    SCORED,
    RunStreams,
)

FORGET_AFTER_S = 600.0  # a generator gone this long (a restarted one has a new id) is no longer listed


class FlowProbe:
    """Reads `Flow` from Redis; remembers the generators it has seen, so one that stopped heart-beating (its
    registry entry expires) is still named, with its last heartbeat."""

    def __init__(self, client: redis.Redis, run: str, clock: Callable[[], float] = time.monotonic):
        self.client, self.clock = client, clock
        self.streams = RunStreams(client, run)
        self.registry = Registry(client, run)
        self.seen: dict[str, Member] = {}
        self.answered_at = clock()

    def redis_silent_s(self) -> float | None:
        """None when Redis answers now; else how long since it last did (for this probe). Asked every
        check, stall or not, so that it also keeps each generator's last heartbeat: an entry that expires
        between two stalls is remembered as it last was."""
        try:
            self.client.ping()
            self._remember()
        except redis.RedisError:
            return self.clock() - self.answered_at
        self.answered_at = self.clock()
        return None

    def _remember(self) -> None:
        for member in self.registry.live():
            self.seen[member.id] = member

    def flow(self) -> Flow:
        """Raises redis.RedisError when Redis does not answer."""
        seconds, micros = self.client.time()
        now = seconds + micros / 1e6  # the registry's clock: heartbeats carry Redis's time
        self._remember()
        self.seen = {i: m for i, m in self.seen.items() if now - m.updated_at < FORGET_AFTER_S}
        prompts_held = self._holding(PROMPTS.name, GENERATOR_GROUP)
        generators = tuple(Replica(i, now - m.updated_at, prompts_held.get(i, (0, 0.0))[0])
                           for i, m in sorted(self.seen.items()))
        rewards = tuple(Replica(name, idle, held)
                        for name, (held, idle) in sorted(self._holding(ROLLOUTS.name, REWARD_GROUP).items()))
        return Flow(self._length(PROMPTS.name), self._length(ROLLOUTS.name), self._length(SCORED.name),
                    generators, rewards, self._read_position(SCORED.name, LEARNER_GROUP))

    def _length(self, stream: str) -> int:
        return int(self.client.xlen(self.streams.key(stream)))  # type: ignore[arg-type]  # an int, not awaitable

    def _read_position(self, stream: str, group: str) -> str | None:
        """The last entry id `group` has read from `stream` (None: no such group yet)."""
        try:
            groups = self.client.xinfo_groups(self.streams.key(stream))
        except redis.ResponseError:  # no such stream yet
            return None
        for g in groups:  # type: ignore[union-attr]  # redis-py types replies as optional
            name = g["name"].decode() if isinstance(g["name"], bytes) else str(g["name"])
            if name == group:
                last = g["last-delivered-id"]
                return last.decode() if isinstance(last, bytes) else str(last)
        return None

    def _holding(self, stream: str, group: str) -> dict[str, tuple[int, float]]:
        """Each consumer of `group`: (entries delivered to it and not acked, seconds since it last read)."""
        try:
            consumers = self.client.xinfo_consumers(self.streams.key(stream), group)
        except redis.ResponseError:  # the stream or its group does not exist yet
            return {}
        out = {}
        for c in consumers:  # type: ignore[union-attr]  # redis-py types replies as optional
            name = c["name"].decode() if isinstance(c["name"], bytes) else str(c["name"])
            out[name] = (int(c["pending"]), int(c["idle"]) / 1000)
        return out

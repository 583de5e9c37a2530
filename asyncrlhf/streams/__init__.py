"""Redis Streams transport: typed producers and consumer groups for the streams of docs/design.md ("Data
flow").

    learner --PromptGroup--> prompts --> generators --RolloutGroup--> rollouts
            --> reward --RolloutGroup (scored)--> scored --> learner
    learner --Event--> events --> evaluator, audit;    anything undecodable or failing --> dead_letter

An entry is two fields: `id` (the message's identity, e.g. its group id) and `pb` (the serialized protobuf).
Nothing else goes on the wire, and nothing read back is unpickled.

This package is the one owner of Redis names (`names`: keys, streams, consumer groups). Its modules:
`connection` (the client), `consumer` (producers, consumer groups and their delivery guarantees),
`dead_letter` (the dead-letter entries), `credits` (the learner's bound on groups in flight), `stats` (queue
depth and lag). `RunStreams`, below, builds all of them for one run; import everything from here.
"""

from __future__ import annotations

import redis

from asyncrlhf.config import Config, RedisConfig
from asyncrlhf.streams.connection import ReplicaWait, connect
from asyncrlhf.streams.consumer import Consumer, ConsumerKeys, Delivery, Producer
from asyncrlhf.streams.credits import PromptCredits
from asyncrlhf.streams.dead_letter import DeadLetter, read_dead_letters
from asyncrlhf.streams.names import (
    CREDITS,
    DEAD_LETTER,
    EVALUATOR_GROUP,
    EVENTS,
    FEED_CURSOR,
    FLOW,
    GENERATOR_GROUP,
    GENERATOR_REGISTRY,
    ID_FIELD,
    LEARNER_DEAD_LETTER_CURSOR,
    LEARNER_FINISHED,
    LEARNER_GROUP,
    LEARNER_WAIT_MARK,
    PARTIALS,
    PAYLOAD_FIELD,
    PROMPTS,
    REWARD_GROUP,
    ROLLOUTS,
    SCORED,
    STREAMS,
    M,
    StreamSpec,
    run_key,
    seen_name,
)
from asyncrlhf.streams.partials import PartialStore
from asyncrlhf.streams.stats import StreamStats, stream_stats

__all__ = [
    "CREDITS", "DEAD_LETTER", "EVALUATOR_GROUP", "EVENTS", "FEED_CURSOR", "FLOW", "GENERATOR_GROUP",
    "GENERATOR_REGISTRY", "ID_FIELD", "LEARNER_DEAD_LETTER_CURSOR", "LEARNER_FINISHED", "LEARNER_GROUP",
    "LEARNER_WAIT_MARK", "PARTIALS", "PAYLOAD_FIELD", "PROMPTS", "REWARD_GROUP", "ROLLOUTS", "SCORED",
    "STREAMS", "Consumer", "DeadLetter", "Delivery", "PartialStore", "Producer", "PromptCredits",
    "ReplicaWait", "RunStreams", "StreamSpec", "StreamStats", "connect", "run_key", "seen_name",
    "stream_stats",
]


class RunStreams:
    """The streams, dead-letter stream and prompt credits of one run: the one place keys are built."""

    def __init__(self, client: redis.Redis, run: str, cfg: RedisConfig | None = None):
        self.client, self.run, self.cfg = client, run, cfg or RedisConfig()

    @classmethod
    def from_config(cls, cfg: Config, client: redis.Redis | None = None) -> RunStreams:
        return cls(client or connect(cfg.redis), cfg.run.name, cfg.redis)

    def key(self, name: str) -> str:
        return run_key(self.run, name)

    def seen_key(self, spec: StreamSpec, group: str) -> str:
        """The identities `group` has acked on `spec`'s stream (their count: groups it has processed)."""
        return self.key(seen_name(spec.name, group))

    def producer(self, spec: StreamSpec[M]) -> Producer[M]:
        return Producer(self.client, self.key(spec.name), spec, self.cfg.stream_maxlen)

    def consumer(self, spec: StreamSpec[M], group: str, consumer: str) -> Consumer[M]:
        keys = ConsumerKeys(self.key(spec.name), self.key(DEAD_LETTER), self.seen_key(spec, group))
        return Consumer(self.client, keys, spec, group, consumer, self.cfg)

    def credits(self, limit: int) -> PromptCredits:
        return PromptCredits(self.client, self.key(CREDITS), limit)

    def partials(self) -> PartialStore:
        """Where continuous generators save their samples in flight."""
        return PartialStore(self.client, self.key(PARTIALS))

    def replica_wait(self) -> ReplicaWait:
        """The learner's WAIT for replicas after its critical writes (a no-op without redis.sentinel)."""
        return ReplicaWait(self.client, self.cfg, self.key(LEARNER_WAIT_MARK))

    def stats(self, spec: StreamSpec, group: str) -> StreamStats:
        return stream_stats(self.client, self.key(spec.name), group, spec.work_queue)

    def dead_letters(self, count: int | None = 100, after: bytes | None = None) -> list[DeadLetter]:
        """The oldest `count` dead-lettered entries of the run (all of them when None), after the entry id
        `after` when given."""
        return read_dead_letters(self.client, self.key(DEAD_LETTER), count, after)

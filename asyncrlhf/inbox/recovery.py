"""Recovery at a learner start, and after a Redis restart or failover: bring Redis in line with the consumed
log (the learner's own fsynced record), enqueueing again the groups whose update or entry was lost."""

from __future__ import annotations

import logging
import time
from collections.abc import Set

import redis

from asyncrlhf.consumed import ConsumedLog, Kind
from asyncrlhf.inbox.feed import PromptFeed
from asyncrlhf.inbox.ids import enqueued_below, group_id, group_index
from asyncrlhf.inbox.metrics import InboxMetrics
from asyncrlhf.streams import FLOW, ID_FIELD, RunStreams

log = logging.getLogger("asyncrlhf.learner")
REDIS_CHECK_S = 1.0  # how often the learner checks whether Redis restarted


def ids_in_streams(streams: RunStreams) -> set[str]:
    """Group ids with an entry in a flow stream or in the dead-letter stream (in flight, or ending)."""
    ids = {d.identity for d in streams.dead_letters(count=None)}
    for spec, _ in FLOW:
        entries = streams.client.xrange(streams.key(spec.name))
        for _, fields in entries:  # type: ignore[union-attr]  # redis-py types replies as optional
            ids.add(fields.get(ID_FIELD, b"").decode(errors="replace"))  # type: ignore[union-attr]
    return ids


class RedisWatch:
    """Notices a Redis restart, or a replica promoted by a failover, by the server's run id."""

    def __init__(self, client: redis.Redis, every_s: float = REDIS_CHECK_S):
        self.client, self.every_s = client, every_s
        self.run_id, self.checked = self._identity(), time.monotonic()

    def _identity(self) -> str:
        return str(self.client.info("server").get("run_id", ""))

    def restarted(self) -> bool:
        """Whether the server changed since the last check (checked at most every `every_s`)."""
        if time.monotonic() - self.checked < self.every_s:
            return False
        self.checked = time.monotonic()
        run_id = self._identity()
        if run_id == self.run_id:
            return False
        log.warning("Redis restarted or failed over (run id %s -> %s): checking the streams against the "
                    "consumed log", self.run_id[:8], run_id[:8])
        self.run_id = run_id
        return True


class Recovery:
    """What a start or a Redis restart repairs. `retrain`: groups whose update was lost (trained only outside
    the current lineage's history), to be trained again."""

    def __init__(self, streams: RunStreams, feed: PromptFeed, consumed: ConsumedLog, finished_key: str,
                 metrics: InboxMetrics):
        self.streams, self.feed, self.consumed, self.finished_key = streams, feed, consumed, finished_key
        self.metrics = metrics
        self.replica_wait = streams.replica_wait()
        self.retrain: set[str] = set()

    def run(self, cursor_floor: int, version: int, present: Set[str] = frozenset(),
            unreleased: Set[str] = frozenset()) -> None:
        """Every group below the cursor either ended for this lineage's model (trained in its history,
        dropped, dead-lettered) or is in flight (an entry of a stream, a dead letter not yet counted, or
        `present`: admitted and not trained yet). Any other is enqueued again under its id: a group trained
        after the resumed checkpoint (its update was lost with the learner; re-enqueueing its prompt samples
        it afresh from the resumed weights, where replaying the stored rollout would train the model on a
        dead lineage's samples, and acked rollouts are deleted), or one whose entry a Redis crash lost.
        Then the finished count and the credits follow from the log; `unreleased` groups (trained, their
        credits freed after the coming push) count as in flight until then."""
        cursor = self._raise_cursor(cursor_floor)
        present = ids_in_streams(self.streams) | present
        ended = self.consumed.ids
        missing = [g for g in map(group_id, range(cursor)) if g not in ended and g not in present]
        self.retrain = self.consumed.trained_elsewhere()  # their update was lost: train them again
        if missing:
            retrain = [g for g in missing if g in self.retrain]
            self.requeue(retrain, version, "update_lost")
            self.requeue([g for g in missing if g not in self.retrain], version, "entry_lost")
            log.warning("lineage %d: enqueued %d groups again (%d trained after the resumed checkpoint, %d "
                        "lost from Redis)", self.consumed.lineage, len(missing), len(retrain),
                        len(missing) - len(retrain))
        finished = sum(1 for g in ended if enqueued_below(g, cursor) and g not in unreleased)
        self.streams.client.set(self.finished_key, finished)
        self.feed.credits.reset(max(0, cursor - finished))
        self.replica_wait(f"recovery at version {version}")

    def _raise_cursor(self, floor: int) -> int:
        """The feed cursor, raised to cover `floor` and every group the log names."""
        logged = [i + 1 for i in map(group_index, self.consumed.ids) if i >= 0]
        current = self.feed.cursor
        cursor = max([current, floor, *logged])
        if cursor != current:  # Redis came back without the cursor (lost, or an older AOF)
            log.warning("feed cursor %d in Redis is behind the learner's records; continuing at %d",
                        current, cursor)
            self.streams.client.set(self.feed.cursor_key, cursor)
            self.feed.known_cursor = cursor
        return cursor

    def requeue(self, group_ids: list[str], version: int, reason: str) -> None:
        """Enqueue groups again under their ids (logged first: a crash in between is repaired at the next
        start, which finds them in no stream)."""
        if group_ids:
            self.consumed.append(Kind.REQUEUED, version, group_ids, lineage=self.consumed.lineage,
                                 reason=reason)
            seen = [self.streams.seen_key(spec, group) for spec, group in FLOW]
            self.feed.requeue(group_ids, version, seen)
            self.metrics.requeued.labels(reason).inc(len(group_ids))

"""Recovery at a learner start, and after a Redis restart: bring Redis in line with the consumed log (the
learner's own fsynced record), enqueueing again the groups whose update or entry was lost."""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING

from asyncrlhf.streams import FLOW, ID_FIELD, RunStreams
from services.learner.feed import group_index

if TYPE_CHECKING:
    from services.learner.schedule import Schedule

log = logging.getLogger("asyncrlhf.learner")


def ids_in_streams(streams: RunStreams) -> set[str]:
    """Group ids with an entry in a flow stream or in the dead-letter stream (in flight, or ending)."""
    ids = {d.identity for d in streams.dead_letters(count=None)}
    for spec, _ in FLOW:
        entries = streams.client.xrange(streams.key(spec.name))
        for _, fields in entries:  # type: ignore[union-attr]  # redis-py types replies as optional
            ids.add(fields.get(ID_FIELD, b"").decode(errors="replace"))  # type: ignore[union-attr]
    return ids



def recover(
    schedule: Schedule, cursor_floor: int, version: int, holding: frozenset[str] | set[str] = frozenset()
) -> None:
    """Bring Redis in line with the consumed log (the learner's own fsynced record) at a start.

    Every group below the cursor either ended for this lineage's model (trained in its history, dropped,
    dead-lettered) or is in flight (an entry of a stream, or a dead letter not yet counted). Any other is
    enqueued again under its id: a group trained after the resumed checkpoint (its update was lost with
    the learner; re-enqueueing its prompt samples it afresh from the resumed weights, where replaying the
    stored rollout would train the model on a dead lineage's samples, and acked rollouts are deleted), or
    one whose entry a Redis crash lost. Then the finished count and the credits follow from the log."""
    logged = [i + 1 for i in map(group_index, schedule.consumed.ids) if i >= 0]
    cursor = max([schedule.feed.cursor, cursor_floor, *logged])
    if cursor != schedule.feed.cursor:  # Redis came back without the cursor (lost, or an older AOF)
        log.warning("feed cursor %d in Redis is behind the learner's records; continuing at %d",
                    schedule.feed.cursor, cursor)
        schedule.client.set(schedule.feed.cursor_key, cursor)
        schedule.feed.known_cursor = cursor
    present = ids_in_streams(schedule.streams) | holding
    missing = [f"g{i:08d}" for i in range(cursor)]
    missing = [g for g in missing if g not in schedule.consumed.ids and g not in present]
    schedule.retrain = schedule.consumed.trained_elsewhere()  # their update was lost: train them again
    if missing:
        retrain = [g for g in missing if g in schedule.retrain]
        requeue(schedule, retrain, version, "update_lost")
        requeue(schedule, [g for g in missing if g not in schedule.retrain], version, "entry_lost")
        log.warning("lineage %d: enqueued %d groups again (%d trained after the resumed checkpoint, %d "
                    "lost from Redis)", schedule.lineage, len(missing), len(retrain),
                    len(missing) - len(retrain))
    finished = sum(1 for g in schedule.consumed.ids if schedule.feed.enqueued(g))
    schedule.client.set(schedule._finished_key, finished)
    schedule.credits.reset(max(0, cursor - finished))
    schedule.replica_wait(f"recovery at version {version}")

def requeue(schedule: Schedule, group_ids: list[str], version: int, reason: str) -> None:
    """Enqueue groups again under their ids (logged first: a crash in between is repaired at the next
    start, which finds them in no stream)."""
    if group_ids:
        schedule.consumed.append("requeued", version, group_ids, lineage=schedule.lineage, reason=reason)
        seen = [schedule.streams.seen_key(spec, group) for spec, group in FLOW]
        schedule.feed.requeue(group_ids, version, seen)
        schedule.metrics.requeued.labels(reason).inc(len(group_ids))


"""The learner's feed: prompt groups enqueued in dataset order, across epochs, under the in-flight bound.

The cursor (how many groups were ever enqueued) lives in Redis, written in the same transaction as the
XADDs, so a restarted learner continues where enqueueing stopped, never re-enqueueing a group id. Group ids
are `g<cursor>` (`asyncrlhf.inbox.ids`); the cursor maps to (epoch, index) in the prompt set's order.
"""

from __future__ import annotations

from collections.abc import Sequence

import redis

from asyncrlhf.inbox.ids import enqueued_below, group_index
from asyncrlhf.inbox.prompts import PromptSet
from asyncrlhf.streams import Producer, PromptCredits


class PromptFeed:
    def __init__(self, client: redis.Redis, producer: Producer, credits: PromptCredits,
                 prompts: PromptSet, *, data_epochs: int, cursor_key: str):
        self.client, self.producer, self.credits, self.prompts = client, producer, credits, prompts
        self.data_epochs, self.cursor_key = data_epochs, cursor_key
        self.lineage = 0  # stamped on every group enqueued (the learner start's lineage)
        self.known_cursor = 0  # the cursor as last read or written here

    @property
    def cursor(self) -> int:
        self.known_cursor = int(self.client.get(self.cursor_key) or 0)
        return self.known_cursor

    @property
    def exhausted(self) -> bool:
        return self.cursor >= self.data_epochs * len(self.prompts)

    def enqueued(self, group: str) -> bool:
        """Whether this feed enqueued `group` (a dead letter with any other id was written by someone else
        and must not release a credit)."""
        return enqueued_below(group, self.cursor)

    def fill(self, version: int) -> int:
        """Enqueue as many groups as credits allow (and the data lasts); returns how many."""
        remaining = self.data_epochs * len(self.prompts) - self.cursor
        granted = self.credits.acquire(min(self.credits.available, max(remaining, 0)))
        if granted == 0:
            return 0
        start = self.cursor
        self._add([start + i for i in range(granted)], version, cursor=start + granted)
        self.known_cursor = start + granted
        return granted

    def requeue(self, group_ids: Sequence[str], version: int, seen_keys: Sequence[str]) -> None:
        """Enqueue groups this feed enqueued before, again, under the same ids (their prompts follow from the
        ids), and forget that any consumer group saw them, so that each stage processes them once more. Only
        for groups in no stream (the caller checks): nothing else holds a copy that could run twice."""
        if not group_ids:
            return
        cursors = [group_index(g) for g in group_ids]
        if -1 in cursors:
            raise ValueError(f"requeue: {group_ids[cursors.index(-1)]!r} is not a group id of this feed")
        self._add(cursors, version, forget=(seen_keys, group_ids))

    def _add(self, cursors: list[int], version: int, cursor: int | None = None,
             forget: tuple[Sequence[str], Sequence[str]] = ((), ())) -> None:
        """XADD the groups at `cursors` in one transaction, with the new `cursor` and the seen-set
        removals."""
        pipe = self.client.pipeline(transaction=True)
        for c in cursors:
            group = self.prompts.group(c, version, self.lineage)
            pipe.xadd(self.producer.key, self.producer.fields(group), maxlen=self.producer.maxlen,
                      approximate=True)
        if cursor is not None:
            pipe.set(self.cursor_key, cursor)
        seen_keys, ids = forget
        for key in seen_keys:
            pipe.zrem(key, *ids)
        pipe.execute()

"""The learner's prompt schedule: dataset order, epochs, and enqueueing under the in-flight bound.

The cursor (how many groups were ever enqueued) lives in Redis, written in the same transaction as the
XADDs, so a restarted learner continues where enqueueing stopped, never re-enqueueing a group id. Group ids
are `g<cursor>`; the cursor maps to (epoch, index) in a permutation of the prompts seeded by
`run.seed + epoch`.
"""

from __future__ import annotations

import re
import time
from collections.abc import Sequence

import redis

from asyncrlhf._proto.rollout_pb2 import PromptGroup
from asyncrlhf.streams import Producer, PromptCredits
from asyncrlhf.tasks import PromptOrder

_GROUP_ID = re.compile(r"g(\d{8,})")


def group_index(group_id: str) -> int:
    """The cursor at which a feed enqueued `group_id` (`g<cursor>`), or -1 for any other id."""
    match = _GROUP_ID.fullmatch(group_id)
    return int(match.group(1)) if match else -1


class PromptFeed:
    def __init__(
        self,
        client: redis.Redis,
        producer: Producer,
        credits: PromptCredits,
        prompts: Sequence[str],
        prompt_ids: Sequence[Sequence[int]],
        *,
        k: int,
        seed: int,
        data_epochs: int,
        cursor_key: str,
        references: Sequence[str | None] = (),
    ):
        if not prompts:
            raise ValueError("the task has no training prompts")
        self.client, self.producer, self.credits = client, producer, credits
        self.prompts, self.prompt_ids = list(prompts), [list(p) for p in prompt_ids]
        self.k, self.seed, self.data_epochs, self.cursor_key = k, seed, data_epochs, cursor_key
        self.references = list(references) or [None] * len(self.prompts)  # a verifiable reward's answers
        self.order = PromptOrder(len(self.prompts), seed)
        self.lineage = 0  # stamped on every group enqueued (the learner start's lineage)
        self.known_cursor = 0  # the cursor as last read or written here

    @property
    def cursor(self) -> int:
        self.known_cursor = int(self.client.get(self.cursor_key) or 0)
        return self.known_cursor

    @property
    def exhausted(self) -> bool:
        return self.cursor >= self.data_epochs * len(self.prompts)

    def position(self, cursor: int) -> tuple[int, int]:
        """(epoch, dataset index) of the cursor-th group ever enqueued."""
        return self.order.position(cursor)

    def enqueued(self, group_id: str) -> bool:
        """Whether this feed enqueued `group_id` (a dead letter with any other id was written by someone else
        and must not release a credit)."""
        match = _GROUP_ID.fullmatch(group_id)
        return match is not None and int(match.group(1)) < self.cursor

    def group(self, cursor: int, version: int) -> PromptGroup:
        epoch, index = self.position(cursor)
        return PromptGroup(
            group_id=f"g{cursor:08d}", prompt=self.prompts[index], prompt_token_ids=self.prompt_ids[index],
            k=self.k, enqueued_at=time.time(), learner_version=version, dataset_index=index, epoch=epoch,
            reference=self.references[index] or "",
            lineage=self.lineage,
        )

    def fill(self, version: int) -> int:
        """Enqueue as many groups as credits allow (and the data lasts); returns how many."""
        remaining = self.data_epochs * len(self.prompts) - self.cursor
        granted = self.credits.acquire(min(self.credits.available, max(remaining, 0)))
        if granted == 0:
            return 0
        start = self.cursor
        groups = [self.group(start + i, version) for i in range(granted)]
        pipe = self.client.pipeline(transaction=True)
        for g in groups:
            pipe.xadd(self.producer.key, self.producer.fields(g), maxlen=self.producer.maxlen,
                      approximate=True)
        pipe.set(self.cursor_key, start + granted)
        pipe.execute()
        self.known_cursor = start + granted
        return granted

    def requeue(self, group_ids: Sequence[str], version: int, seen_keys: Sequence[str]) -> None:
        """Enqueue groups this feed enqueued before, again, under the same ids (their prompts follow from the
        ids), and forget that any consumer group saw them, so that each stage processes them once more. Only
        for groups in no stream (the caller checks): nothing else holds a copy that could run twice."""
        if not group_ids:
            return
        pipe = self.client.pipeline(transaction=True)
        for gid in group_ids:
            match = _GROUP_ID.fullmatch(gid)
            if match is None:
                raise ValueError(f"requeue: {gid!r} is not a group id of this feed")
            g = self.group(int(match.group(1)), version)
            pipe.xadd(self.producer.key, self.producer.fields(g), maxlen=self.producer.maxlen,
                      approximate=True)
        for key in seen_keys:
            pipe.zrem(key, *group_ids)
        pipe.execute()

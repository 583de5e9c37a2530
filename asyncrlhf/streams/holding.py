"""Holding a consumer's pending entries while it cannot: a thread that keeps them from being re-claimed.

A consumer that keeps entries read but not acked holds them itself (`consumer.hold`, `Keeper`) as it works.
Some waits stop that work for longer than `claim_idle_ms`: a generator's loop waits while a weight push
holds its backend (a long broadcast, a file reload of a large model). `PendingHolder.held()` covers such a
wait: every quarter of `claim_idle_ms` it holds every entry pending to the consumer (XPENDING's list for it,
then XCLAIM to the same consumer, min-idle 0, JUSTID: the idle time resets, no delivery is counted), so
another consumer's XAUTOCLAIM never takes groups that are still being worked on. It holds what is pending,
not what the loop is working on: an entry the loop left pending to be re-claimed (to retry it elsewhere)
waits out the push as well, then goes as before.
"""

from __future__ import annotations

import contextlib
import logging
import threading
from collections.abc import Iterator

import redis

from asyncrlhf.streams.consumer import Consumer

log = logging.getLogger(__name__)
MOST_PENDING = 10_000  # entries held per pass: far more than a generator keeps in flight


class PendingHolder:
    """Holds every entry pending to `consumer` every `claim_idle_ms / 4` while `held()` runs."""

    def __init__(self, consumer: Consumer, claim_idle_ms: int):
        self.consumer, self.every_s = consumer, claim_idle_ms / 4000

    @contextlib.contextmanager
    def held(self) -> Iterator[None]:
        """Hold on a thread of its own until the block ends (the first hold a quarter of `claim_idle_ms` in:
        a short wait costs nothing)."""
        done = threading.Event()
        thread = threading.Thread(target=self._run, args=(done,), name="hold-pending", daemon=True)
        thread.start()
        try:
            yield
        finally:
            done.set()
            thread.join()

    def _run(self, done: threading.Event) -> None:
        while not done.wait(self.every_s):
            try:
                self.hold_pending()
            except redis.RedisError as err:  # Redis away: nothing to hold against; the next pass tries again
                log.warning("could not hold the entries pending to %s: %s", self.consumer.name, err)

    def hold_pending(self) -> int:
        """Hold every entry pending to the consumer now; how many."""
        c = self.consumer
        pending = c.client.xpending_range(c.key, c.group, "-", "+", MOST_PENDING, consumername=c.name)
        ids: list[bytes | str | int | memoryview] = [p["message_id"] for p in pending]
        if ids:
            c.client.xclaim(c.key, c.group, c.name, 0, ids, justid=True)
        return len(ids)

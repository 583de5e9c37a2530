"""The dead-letter stream's entries: what a consumer writes when an entry cannot be processed (the reason and
the original payload), and how they read back."""

from __future__ import annotations

import time
from dataclasses import dataclass

import redis


@dataclass(frozen=True)
class DeadLetter:
    """An entry that could not be processed, as stored in the dead-letter stream."""

    entry_id: bytes
    stream: str
    group: str
    consumer: str
    source_entry_id: str
    identity: str
    reason: str
    deliveries: int
    payload: bytes
    at: float


@dataclass(frozen=True)
class Origin:
    """Who gave up on an entry: the stream it was read from (the spec's name), the consumer group and the
    consumer."""

    stream: str
    group: str
    consumer: str


def dead_letter_fields(origin: Origin, source_entry_id: bytes, identity: str, reason: str, deliveries: int,
                       payload: bytes) -> dict:
    """The fields of one dead-letter entry, stamped now."""
    return {
        "stream": origin.stream, "group": origin.group, "consumer": origin.consumer,
        "entry_id": source_entry_id, "id": identity, "reason": reason, "deliveries": deliveries,
        "payload": payload, "at": time.time(),
    }


def read_dead_letters(client: redis.Redis, key: str, count: int | None = None,
                      after: bytes | None = None) -> list[DeadLetter]:
    """The oldest `count` entries (all of them when None) of the dead-letter stream `key`; with `after` (an
    entry id, e.g. the last one a reader handled), only the entries after it."""
    start = f"({after.decode()}" if after is not None else "-"
    # redis-py's stub types XRANGE as optional str | bytes; without decode_responses it is a list of bytes
    entries = client.xrange(key, min=start, count=count)
    return [_parse(eid, fields) for eid, fields in entries]  # type: ignore[arg-type, union-attr]


def _parse(eid: bytes, f: dict[bytes, bytes]) -> DeadLetter:
    text = lambda k: f.get(k, b"").decode("utf-8", "replace")  # noqa: E731
    return DeadLetter(
        entry_id=eid, stream=text(b"stream"), group=text(b"group"), consumer=text(b"consumer"),
        source_entry_id=text(b"entry_id"), identity=text(b"id"), reason=text(b"reason"),
        deliveries=int(f.get(b"deliveries", 0)), payload=f.get(b"payload", b""), at=float(f.get(b"at", 0)),
    )

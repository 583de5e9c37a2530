"""Stream statistics: queue depth, consumer lag and pending entries of a stream and group."""

from __future__ import annotations

from dataclasses import dataclass

import redis


@dataclass(frozen=True)
class StreamStats:
    """Queue depth and consumer lag of one stream and group, for metrics and flow control."""

    length: int  # entries in the stream (for a work queue: not yet acked)
    lag: int  # entries not yet delivered to the group
    pending: int  # delivered to the group, not yet acked
    consumers: int


def stream_stats(client: redis.Redis, key: str, group: str, work_queue: bool = True) -> StreamStats:
    """Length, lag, pending and consumers of `group` on stream `key` (zeros if neither exists yet)."""
    try:
        length = client.xlen(key)
        groups = client.xinfo_groups(key)
    except redis.ResponseError:  # no such stream
        return StreamStats(0, 0, 0, 0)
    info = next((g for g in groups if g["name"] in (group, group.encode())), None)
    if info is None:
        return StreamStats(length, length, 0, 0)
    pending = int(info["pending"])
    lag = info.get("lag")
    if lag is None:  # Redis < 7 has no lag field
        lag = max(0, length - pending) if work_queue else _count_after(client, key, info["last-delivered-id"])
    return StreamStats(length, int(lag), pending, int(info["consumers"]))


def _count_after(client: redis.Redis, key: str, last_id: bytes, cap: int = 100_000) -> int:
    last = last_id.decode() if isinstance(last_id, bytes) else last_id
    entries = client.xrange(key, min=f"({last}" if last != "0-0" else "-", count=cap)
    return len(entries)  # type: ignore[arg-type]  # redis-py's stub adds None; XRANGE returns a list

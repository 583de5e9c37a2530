"""Producers and consumer groups of one stream, and their guarantees.

Delivery is at-least-once and processing is exactly-once downstream:
- a consumer reads through a consumer group and acks explicitly; entries pending on a dead or stuck consumer
  longer than `claim_idle_ms` are re-claimed (XAUTOCLAIM) by a live one;
- `Consumer.ack` is one atomic script: mark each identity seen, emit each delivery's output (only if its
  identity was not seen before), XACK (and, for work queues, XDEL). A consumer killed before the script ran
  leaves the entry pending (it is redone); killed after, the entry is done. Either way nothing is doubled;
- reads skip (and ack) identities already seen, so a group enqueued twice is processed once; the seen-set
  lives in Redis, so it survives consumer restarts;
- an entry that fails to decode, or is delivered more than `max_deliveries` times, goes to the dead-letter
  stream with the reason and its original payload, and is acked.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Any, Generic

import redis
from google.protobuf.message import DecodeError, Message
from redis.typing import EncodableT, FieldT

from asyncrlhf.config import RedisConfig
from asyncrlhf.streams.dead_letter import Origin, dead_letter_fields
from asyncrlhf.streams.names import ID_FIELD, PAYLOAD_FIELD, M, StreamSpec

log = logging.getLogger(__name__)

SEEN_TTL_S = 7 * 24 * 3600.0


@dataclass(frozen=True)
class ConsumerKeys:
    """The Redis keys one consumer works on: its stream, the run's dead-letter stream, and the sorted set of
    identities its group has acked (the seen-set), all built by `RunStreams`."""

    stream: str
    dead_letter: str
    seen: str


@dataclass
class Delivery(Generic[M]):
    """One entry handed to a consumer: ack it (with its output, if any) once processed."""

    entry_id: bytes
    identity: str
    message: M
    deliveries: int  # 1 on first delivery; each re-claim adds one


class Producer(Generic[M]):
    """Appends messages of one spec to one stream, capped at about `maxlen` entries."""

    def __init__(self, client: redis.Redis, key: str, spec: StreamSpec[M], maxlen: int):
        self.client, self.key, self.spec, self.maxlen = client, key, spec, maxlen

    def add(self, message: M) -> bytes:
        return self.add_many([message])[0]

    def add_many(self, messages: Iterable[M], atomic: bool = False) -> list[bytes]:
        """XADD every message in one round trip; returns the entry ids. With `atomic`, in one MULTI/EXEC: a
        consumer blocked on the stream then wakes to all of them, never to the first alone."""
        pipe = self.client.pipeline(transaction=atomic)
        for message in messages:
            pipe.xadd(self.key, self.fields(message), maxlen=self.maxlen, approximate=True)
        return pipe.execute()

    def fields(self, message: M) -> dict[FieldT, EncodableT]:
        if not isinstance(message, self.spec.message_type):
            raise TypeError(f"stream `{self.spec.name}` carries {self.spec.message_type.__name__}, "
                            f"not {type(message).__name__}")
        return {ID_FIELD: self.spec.identity(message), PAYLOAD_FIELD: message.SerializeToString()}


# Mark identities seen, emit outputs for identities not seen before, ack (and delete) the inputs.
# KEYS: stream, seen, output stream. ARGV: group, now, maxlen, delete_on_ack, n, with_outputs, then n x
# (entry id, identity), then, with outputs, n x (has output, output identity, output payload).
# Returns the number of outputs emitted. An output entry's two fields are ID_FIELD and PAYLOAD_FIELD.
_ACK = """
local n, emitted, ids = tonumber(ARGV[5]), 0, {}
local outputs = 7 + 2 * n
for i = 0, n - 1 do
  ids[i + 1] = ARGV[7 + 2 * i]
  local fresh = redis.call('ZADD', KEYS[2], 'NX', ARGV[2], ARGV[8 + 2 * i]) == 1
  local out = outputs + 3 * i
  if fresh and ARGV[6] == '1' and ARGV[out] == '1' then
    redis.call('XADD', KEYS[3], 'MAXLEN', '~', ARGV[3], '*', 'id', ARGV[out + 1], 'pb', ARGV[out + 2])
    emitted = emitted + 1
  end
end
for i = 1, n, 1000 do
  local slice = {unpack(ids, i, math.min(i + 999, n))}
  redis.call('XACK', KEYS[1], ARGV[1], unpack(slice))
  if ARGV[4] == '1' then redis.call('XDEL', KEYS[1], unpack(slice)) end
end
return emitted
"""


def _output_args(to: Producer, outputs: Sequence[Message | None]) -> list:
    """The ack script's (has output, output identity, output payload) of each output."""
    args: list = []
    for out in outputs:
        fields = to.fields(out) if out is not None else None
        args += ("1", fields[ID_FIELD], fields[PAYLOAD_FIELD]) if fields else ("0", "", "")
    return args


class SeenSet:
    """A group's done identities (a sorted set scored by the time each was acked; the ack script adds to it):
    what lets a redelivered or re-sent entry be skipped. Entries older than SEEN_TTL_S are pruned, at most
    once a minute."""

    def __init__(self, client: redis.Redis, key: str):
        self.client, self.key = client, key
        self._next_prune = 0.0

    def has(self, identity: str) -> bool:
        return self.client.zscore(self.key, identity) is not None

    def which(self, idents: Sequence[Any]) -> list[bool]:
        """For each identity (None: an entry without one), whether it is done; one round trip."""
        known = [i for i in idents if i is not None]
        scores = dict(zip(known, self.client.zmscore(self.key, known), strict=True)) if known else {}
        return [scores.get(ident) is not None for ident in idents]

    def prune(self) -> None:
        now = time.monotonic()
        if now >= self._next_prune:
            self._next_prune = now + 60
            self.client.zremrangebyscore(self.key, "-inf", time.time() - SEEN_TTL_S)


class Consumer(Generic[M]):
    """One named consumer in a consumer group of one stream. See the module docstring for the guarantees."""

    def __init__(self, client: redis.Redis, keys: ConsumerKeys, spec: StreamSpec[M], group: str,
                 consumer: str, cfg: RedisConfig | None = None):
        self.client, self.key, self.spec, self.group, self.name = client, keys.stream, spec, group, consumer
        self.dead_letter_key, self.seen_key = keys.dead_letter, keys.seen
        self._seen = SeenSet(client, keys.seen)
        self._origin = Origin(spec.name, group, consumer)
        cfg = cfg or RedisConfig()
        self.claim_idle_ms, self.max_deliveries = cfg.claim_idle_ms, cfg.max_deliveries
        self.block_ms, self.maxlen = cfg.block_ms, cfg.stream_maxlen
        self.duplicates_skipped = 0
        self.dead_lettered = 0
        self._delete = "1" if spec.work_queue else "0"
        self._ack = client.register_script(_ACK)
        self._claim_cursor = b"0-0"
        self._next_claim = 0.0
        self.ensure_group()

    def ensure_group(self) -> None:
        """Create the group (reading from the stream's start) if it does not exist yet."""
        try:
            self.client.xgroup_create(self.key, self.group, id="0", mkstream=True)
        except redis.ResponseError as err:
            if "BUSYGROUP" not in str(err):
                raise

    def read(self, count: int, block_ms: int | None = None) -> list[Delivery[M]]:
        """Up to `count` deliveries: entries re-claimed from stalled consumers first, then new ones, waiting
        to `block_ms` (default `redis.block_ms`) when there are none. Undecodable entries, and entries
        delivered too often, go to the dead-letter stream; identities already seen are acked and skipped."""
        try:
            return self._read(count, self.block_ms if block_ms is None else block_ms)
        except redis.ResponseError as err:
            if "NOGROUP" not in str(err):
                raise
            log.warning("consumer group %s on %s is gone (Redis restarted empty?); re-creating it",
                        self.group, self.key)
            self.ensure_group()
            return []

    def ack(
        self,
        deliveries: Sequence[Delivery[M]],
        outputs: Sequence[Message | None] | None = None,
        to: Producer | None = None,
    ) -> int:
        """Atomically mark `deliveries` done and write `outputs[i]` (the result of `deliveries[i]`, or None)
        to `to`; an output whose input identity was already done is not written again. Returns outputs
        written."""
        if not deliveries:
            return 0
        if outputs is not None and (to is None or len(outputs) != len(deliveries)):
            raise ValueError("ack: outputs need a producer `to` and one entry (or None) per delivery")
        maxlen = to.maxlen if to else self.maxlen
        with_outputs = "0" if outputs is None else "1"
        args: list = [self.group, time.time(), maxlen, self._delete, len(deliveries), with_outputs]
        for delivery in deliveries:
            args += (delivery.entry_id, delivery.identity)
        if outputs is not None and to is not None:  # checked above: outputs come with `to`
            args += _output_args(to, outputs)
        out_key = to.key if to else self.key
        emitted = self._ack(keys=[self.key, self.seen_key, out_key], args=args)
        self._seen.prune()
        return int(emitted)

    def fail(self, delivery: Delivery[M], reason: str) -> None:
        """Processing `delivery` failed. After `max_deliveries` attempts it is dead-lettered with `reason`;
        before that it stays pending and is re-claimed (by any live consumer) after `claim_idle_ms`."""
        if delivery.deliveries >= self.max_deliveries:
            self.dead_letter(delivery, f"failed {delivery.deliveries} times; last error: {reason}")

    def dead_letter(self, delivery: Delivery[M], reason: str) -> None:
        """Dead-letter `delivery` now, with `reason`, and ack it (it can never succeed, e.g. malformed)."""
        self._dead_letter(delivery.entry_id, delivery.identity, delivery.message.SerializeToString(), reason,
                          delivery.deliveries)

    def seen(self, identity: str) -> bool:
        """Whether an entry with this identity was already acked by this group."""
        return self._seen.has(identity)

    # -- internals ---------------------------------------------------------------------------------------

    def _read(self, count: int, block_ms: int) -> list[Delivery[M]]:
        out = self._claim_stalled(count)
        if len(out) >= count:
            return out
        entries, read = self._read_new(count - len(out), None)
        if not read and not out and block_ms > 0:
            entries, _ = self._read_new(count, block_ms)
        return out + self._deliver(entries, deliveries={})

    def _read_new(self, count: int, block_ms: int | None) -> tuple[list[tuple[bytes, dict]], int]:
        """New entries (XREADGROUP, waiting up to `block_ms` if given), those already seen acked and dropped;
        and how many were read."""
        res = self.client.xreadgroup(self.group, self.name, {self.key: ">"}, count=count, block=block_ms)
        # redis-py's stub gives the RESP3 dict; this RESP2 client returns [[stream, entries]]
        entries: list[tuple[bytes, dict]] = res[0][1] if res else []  # type: ignore[index, assignment]
        return self._drop_seen(entries), len(entries)

    def _drop_seen(self, entries: list[tuple[bytes, dict]]) -> list[tuple[bytes, dict]]:
        seen = self._seen.which([fields.get(ID_FIELD) for _, fields in entries])
        dup_ids = [eid for (eid, _), dup in zip(entries, seen, strict=True) if dup]
        if dup_ids:
            self._ack_raw(dup_ids)
            self.duplicates_skipped += len(dup_ids)
        return [entry for entry, dup in zip(entries, seen, strict=True) if not dup]

    def _claim_stalled(self, count: int) -> list[Delivery[M]]:
        """XAUTOCLAIM entries idle longer than claim_idle_ms, at most every claim_idle_ms / 2."""
        now = time.monotonic()
        if now < self._next_claim:
            return []
        cursor, claimed = self.client.xautoclaim(self.key, self.group, self.name, self.claim_idle_ms,
                                                 self._claim_cursor, count=count)[:2]
        self._claim_cursor = cursor
        if cursor == b"0-0":  # a full pass: wait before the next one
            self._next_claim = now + self.claim_idle_ms / 2000
        deleted = [eid for eid, fields in claimed if not fields]
        if deleted:
            self._ack_raw(deleted)
        live = [(eid, fields) for eid, fields in claimed if fields]
        if not live:
            return []
        pending = self.client.xpending_range(self.key, self.group, min=live[0][0], max=live[-1][0],
                                             count=len(live) * 2, consumername=self.name)
        counts = {p["message_id"]: p["times_delivered"] for p in pending}
        fresh = self._drop_seen(live)
        return self._deliver(fresh, deliveries=counts)  # type: ignore[arg-type]  # redis-py's stub: str | int

    def _deliver(self, entries: list[tuple[bytes, dict]], deliveries: dict[bytes, int]) -> list[Delivery[M]]:
        out: list[Delivery[M]] = []
        for eid, fields in entries:
            times = deliveries.get(eid, 1)
            ident = fields.get(ID_FIELD, b"").decode("utf-8", "replace")
            payload = fields.get(PAYLOAD_FIELD)
            if times > self.max_deliveries:
                self._dead_letter(eid, ident, payload or b"",
                                  f"delivered {times} times without an ack "
                                  f"(max_deliveries={self.max_deliveries})",
                                  times)
                continue
            message = self._decode(eid, ident, payload, times)
            if message is not None:
                out.append(Delivery(eid, ident, message, times))
        return out

    def _decode(self, eid: bytes, ident: str, payload: bytes | None, times: int) -> M | None:
        if payload is None or not ident:
            self._dead_letter(eid, ident, payload or b"", "entry lacks the `id` or `pb` field", times)
            return None
        message = self.spec.message_type()
        try:
            message.ParseFromString(payload)
        except (DecodeError, RuntimeError) as err:
            reason = f"cannot decode {self.spec.message_type.__name__}: {err}"
            self._dead_letter(eid, ident, payload, reason, times)
            return None
        return message

    def _dead_letter(self, eid: bytes, ident: str, payload: bytes, reason: str, times: int) -> None:
        log.warning("dead-lettering %s entry %s (%s): %s", self.spec.name, eid.decode(), ident, reason)
        pipe = self.client.pipeline(transaction=True)
        fields = dead_letter_fields(self._origin, eid, ident, reason, times, payload)
        pipe.xadd(self.dead_letter_key, fields, maxlen=self.maxlen, approximate=True)
        self._ack_raw([eid], pipe)
        pipe.execute()
        self.dead_lettered += 1

    def _ack_raw(self, entry_ids: list[bytes], pipe=None) -> None:
        """XACK (and, for a work queue, XDEL) `entry_ids`: queued on `pipe` if given, else at once."""
        now = pipe is None
        pipe = self.client.pipeline(transaction=True) if now else pipe
        pipe.xack(self.key, self.group, *entry_ids)
        if self.spec.work_queue:
            pipe.xdel(self.key, *entry_ids)
        if now:
            pipe.execute()


def hold(consumer: Consumer, deliveries: Sequence[Delivery]) -> None:
    """Keep `deliveries` (read by `consumer`, deliberately not acked yet) from being re-claimed as stalled:
    resets their idle time without counting a delivery (XCLAIM to the same consumer, min-idle 0, JUSTID)."""
    if deliveries:
        ids: list[bytes | str | int | memoryview] = [d.entry_id for d in deliveries]
        consumer.client.xclaim(consumer.key, consumer.group, consumer.name, 0, ids, justid=True)


class Keeper:
    """`hold` at most every quarter of `claim_idle_ms`: for a consumer that keeps entries read but not yet
    acked while it waits for more (a learner's step being collected, a controlled mode's held groups)."""

    def __init__(self, consumer: Consumer, claim_idle_ms: int):
        self.consumer, self.every_s, self._kept = consumer, claim_idle_ms / 4000, 0.0

    def keep(self, deliveries: Sequence[Delivery]) -> None:
        now = time.monotonic()
        if deliveries and now - self._kept >= self.every_s:
            hold(self.consumer, deliveries)
            self._kept = now

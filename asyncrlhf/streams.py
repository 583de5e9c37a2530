"""Redis Streams transport: typed producers and consumer groups for the streams of DESIGN.md "Data flow".

    learner --PromptGroup--> prompts --> generators --RolloutGroup--> rollouts
            --> reward --RolloutGroup (scored)--> scored --> learner
    learner --Event--> events --> evaluator, audit;    anything undecodable or failing --> dead_letter

An entry is two fields: `id` (the message's identity, e.g. its group id) and `pb` (the serialized protobuf).
Nothing else goes on the wire, and nothing read back is unpickled.

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

`PromptCredits` is the learner's bound on groups in flight, and `StreamStats` gives queue depth and consumer
lag for metrics and flow control.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass
from typing import Callable, Generic, Iterable, Sequence, TypeVar

import redis
from google.protobuf.message import DecodeError, Message
from redis.backoff import ExponentialWithJitterBackoff
from redis.retry import Retry

from asyncrlhf._proto.events_pb2 import Event
from asyncrlhf._proto.rollout_pb2 import PromptGroup, RolloutGroup
from asyncrlhf.config import Config, RedisConfig

log = logging.getLogger(__name__)

M = TypeVar("M", bound=Message)

ID_FIELD = b"id"
PAYLOAD_FIELD = b"pb"
DEAD_LETTER = "dead_letter"
SEEN_TTL_S = 7 * 24 * 3600.0


@dataclass(frozen=True)
class StreamSpec(Generic[M]):
    """A stream of one message type. A work queue has a single consumer group, so acked entries are deleted
    (the stream's length is then its backlog); a broadcast stream keeps entries for every group."""

    name: str
    message_type: type[M]
    identity: Callable[[M], str]
    work_queue: bool = True


PROMPTS = StreamSpec("prompts", PromptGroup, lambda m: m.group_id)
ROLLOUTS = StreamSpec("rollouts", RolloutGroup, lambda m: m.group_id)
SCORED = StreamSpec("scored", RolloutGroup, lambda m: m.group_id)
EVENTS = StreamSpec("events", Event, lambda m: m.event_id, work_queue=False)
STREAMS: dict[str, StreamSpec] = {s.name: s for s in (PROMPTS, ROLLOUTS, SCORED, EVENTS)}


def run_key(run: str, name: str) -> str:
    """Redis key of a stream or record of a run (the same as `Config.key`)."""
    return f"asyncrlhf:{run}:{name}"


class _Reconnect(Retry):
    """Retries lost connections, never a refused password: redis-py's AuthenticationError is a
    ConnectionError, and a service retrying it forever would hang silently instead of saying why."""

    def call_with_retry(self, do, fail, is_retryable=None, with_failure_count=False):
        def retryable(err: Exception) -> bool:
            refused = isinstance(err, redis.AuthenticationError)
            return not refused and (is_retryable is None or is_retryable(err))

        return super().call_with_retry(do, fail, retryable, with_failure_count)


def connect(cfg: RedisConfig, url: str | None = None, *, retries: int = -1) -> redis.Redis:
    """A client for `url` (default `cfg.url`) that reconnects with jittered exponential back-off, capped at
    `cfg.reconnect_max_s`, on connection errors; `retries=-1` keeps trying, as a service should while Redis
    restarts. A wrong or missing password fails at once. Responses are bytes (payloads are binary)."""
    url = url or cfg.url
    if not url:
        raise ValueError(
            "redis.url is not set: pass redis.url=redis://host:6379/0, or start an embedded server with "
            "asyncrlhf.redis_server.EmbeddedRedis (what `asyncrlhf up` does)"
        )
    kwargs: dict = {
        "retry": _Reconnect(ExponentialWithJitterBackoff(cap=cfg.reconnect_max_s, base=0.05), retries),
        "retry_on_error": [redis.ConnectionError, redis.TimeoutError],
        "socket_keepalive": True,
        "health_check_interval": 30,
    }
    if cfg.password and "@" not in url:
        kwargs["password"] = cfg.password
    if url.startswith("rediss://") and cfg.tls_ca_certs:
        kwargs["ssl_ca_certs"] = cfg.tls_ca_certs
    return redis.Redis.from_url(url, **kwargs)


@dataclass
class Delivery(Generic[M]):
    """One entry handed to a consumer: ack it (with its output, if any) once processed."""

    entry_id: bytes
    identity: str
    message: M
    deliveries: int  # 1 on first delivery; each re-claim adds one


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
class StreamStats:
    """Queue depth and consumer lag of one stream and group, for metrics and flow control."""

    length: int  # entries in the stream (for a work queue: not yet acked)
    lag: int  # entries not yet delivered to the group
    pending: int  # delivered to the group, not yet acked
    consumers: int


class Producer(Generic[M]):
    """Appends messages of one spec to one stream, capped at about `maxlen` entries."""

    def __init__(self, client: redis.Redis, key: str, spec: StreamSpec[M], maxlen: int):
        self.client, self.key, self.spec, self.maxlen = client, key, spec, maxlen

    def add(self, message: M) -> bytes:
        return self.add_many([message])[0]

    def add_many(self, messages: Iterable[M]) -> list[bytes]:
        """XADD every message in one round trip; returns the entry ids."""
        pipe = self.client.pipeline(transaction=False)
        for message in messages:
            pipe.xadd(self.key, self.fields(message), maxlen=self.maxlen, approximate=True)
        return pipe.execute()

    def fields(self, message: M) -> dict[bytes, bytes | str]:
        if not isinstance(message, self.spec.message_type):
            raise TypeError(f"stream `{self.spec.name}` carries {self.spec.message_type.__name__}, "
                            f"not {type(message).__name__}")
        return {ID_FIELD: self.spec.identity(message), PAYLOAD_FIELD: message.SerializeToString()}


# Mark identities seen, emit outputs for identities not seen before, ack (and delete) the inputs.
# KEYS: stream, seen, output stream. ARGV: group, now, maxlen, delete_on_ack, n, with_outputs, then n x
# (entry id, identity), then, with outputs, n x (has output, output identity, output payload).
# Returns the number of outputs emitted.
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


class Consumer(Generic[M]):
    """One named consumer in a consumer group of one stream. See the module docstring for the guarantees."""

    def __init__(
        self,
        client: redis.Redis,
        key: str,
        spec: StreamSpec[M],
        group: str,
        consumer: str,
        *,
        dead_letter_key: str,
        seen_key: str,
        cfg: RedisConfig = RedisConfig(),
        seen_ttl_s: float = SEEN_TTL_S,
    ):
        self.client, self.key, self.spec, self.group, self.name = client, key, spec, group, consumer
        self.dead_letter_key, self.seen_key, self.seen_ttl_s = dead_letter_key, seen_key, seen_ttl_s
        self.claim_idle_ms, self.max_deliveries = cfg.claim_idle_ms, cfg.max_deliveries
        self.block_ms, self.maxlen = cfg.block_ms, cfg.stream_maxlen
        self.duplicates_skipped = 0
        self.dead_lettered = 0
        self._delete = "1" if spec.work_queue else "0"
        self._ack = client.register_script(_ACK)
        self._claim_cursor = b"0-0"
        self._next_claim = 0.0
        self._next_prune = 0.0
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
        for out in outputs or ():
            if out is None:
                args += ("0", "", "")
            else:
                fields = to.fields(out)
                args += ("1", fields[ID_FIELD], fields[PAYLOAD_FIELD])
        out_key = to.key if to else self.key
        emitted = self._ack(keys=[self.key, self.seen_key, out_key], args=args)
        self._maybe_prune_seen()
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
        return self.client.zscore(self.seen_key, identity) is not None

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
        entries = res[0][1] if res else []
        return self._drop_seen(entries), len(entries)

    def _drop_seen(self, entries: list[tuple[bytes, dict]]) -> list[tuple[bytes, dict]]:
        idents = [fields.get(ID_FIELD) for _, fields in entries]
        known = [i for i in idents if i is not None]
        scores = dict(zip(known, self.client.zmscore(self.seen_key, known))) if known else {}
        dup_ids = [eid for (eid, _), ident in zip(entries, idents) if scores.get(ident) is not None]
        if dup_ids:
            self._ack_raw(dup_ids)
            self.duplicates_skipped += len(dup_ids)
        return [(eid, f) for (eid, f), ident in zip(entries, idents) if scores.get(ident) is None]

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
        return self._deliver(fresh, deliveries=counts)

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
        pipe.xadd(self.dead_letter_key, {
            "stream": self.spec.name, "group": self.group, "consumer": self.name, "entry_id": eid,
            "id": ident, "reason": reason, "deliveries": times, "payload": payload, "at": time.time(),
        }, maxlen=self.maxlen, approximate=True)
        pipe.xack(self.key, self.group, eid)
        if self.spec.work_queue:
            pipe.xdel(self.key, eid)
        pipe.execute()
        self.dead_lettered += 1

    def _ack_raw(self, entry_ids: list[bytes]) -> None:
        pipe = self.client.pipeline(transaction=True)
        pipe.xack(self.key, self.group, *entry_ids)
        if self.spec.work_queue:
            pipe.xdel(self.key, *entry_ids)
        pipe.execute()

    def _maybe_prune_seen(self) -> None:
        now = time.monotonic()
        if now >= self._next_prune:
            self._next_prune = now + 60
            self.client.zremrangebyscore(self.seen_key, "-inf", time.time() - self.seen_ttl_s)


class PromptCredits:
    """The learner's bound on prompt groups in flight (enqueued, not yet trained on or dropped).

    The count lives in Redis, so a restarted learner resumes with the groups still in the pipes counted.
    `acquire` grants at most what is free, atomically; `release` returns credits once groups are trained,
    dropped or dead-lettered. The client retries a command whose reply was lost (Redis restarting), so a
    release names what it releases (`token`): a second release under the same token changes nothing, and
    the bound holds across a Redis restart.
    """

    _ACQUIRE = """
    local cur = tonumber(redis.call('GET', KEYS[1]) or '0')
    local grant = math.min(tonumber(ARGV[1]), tonumber(ARGV[2]) - cur)
    if grant <= 0 then return 0 end
    redis.call('INCRBY', KEYS[1], grant)
    return grant
    """
    # KEYS: count, token marker (or the count again: no token), finished counter (or the count again).
    # ARGV: n, has token, has finished counter, token ttl (s).
    _RELEASE = """
    local cur = tonumber(redis.call('GET', KEYS[1]) or '0')
    if ARGV[2] == '1' and not redis.call('SET', KEYS[2], '1', 'NX', 'EX', ARGV[4]) then return cur end
    local new = math.max(0, cur - tonumber(ARGV[1]))
    redis.call('SET', KEYS[1], new)
    if ARGV[3] == '1' then redis.call('INCRBY', KEYS[3], ARGV[1]) end
    return new
    """
    TOKEN_TTL_S = 7 * 24 * 3600

    def __init__(self, client: redis.Redis, key: str, limit: int):
        if limit < 1:
            raise ValueError(f"PromptCredits limit must be >= 1, got {limit}")
        self.client, self.key, self.limit = client, key, limit
        self._acquire = client.register_script(self._ACQUIRE)
        self._release = client.register_script(self._RELEASE)

    @property
    def in_flight(self) -> int:
        return int(self.client.get(self.key) or 0)

    @property
    def available(self) -> int:
        return max(0, self.limit - self.in_flight)

    def acquire(self, n: int) -> int:
        """Take up to `n` credits; returns how many were granted (0 when the bound is reached)."""
        return int(self._acquire(keys=[self.key], args=[n, self.limit])) if n > 0 else 0

    def release(self, n: int, token: str | None = None, finished_key: str | None = None) -> int:
        """Return `n` credits (never below zero) and, atomically, add `n` to the counter `finished_key` (if
        given); returns the groups still in flight. With a `token` (unique to this release, e.g. the id of a
        group it finishes) a repeated release, such as a retry after a lost reply, is a no-op."""
        if n <= 0:
            return self.in_flight
        marker = f"{self.key}:released:{token}" if token is not None else self.key
        keys = [self.key, marker, finished_key or self.key]
        args = [n, "1" if token is not None else "0", "1" if finished_key else "0", self.TOKEN_TTL_S]
        return int(self._release(keys=keys, args=args))

    def reset(self, in_flight: int = 0) -> None:
        self.client.set(self.key, in_flight)


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
    return len(client.xrange(key, min=f"({last}" if last != "0-0" else "-", count=cap))


class RunStreams:
    """The streams, dead-letter stream and prompt credits of one run: the one place keys are built."""

    def __init__(self, client: redis.Redis, run: str, cfg: RedisConfig = RedisConfig()):
        self.client, self.run, self.cfg = client, run, cfg

    @classmethod
    def from_config(cls, cfg: Config, client: redis.Redis | None = None) -> "RunStreams":
        return cls(client or connect(cfg.redis), cfg.run.name, cfg.redis)

    def key(self, name: str) -> str:
        return run_key(self.run, name)

    def producer(self, spec: StreamSpec[M]) -> Producer[M]:
        return Producer(self.client, self.key(spec.name), spec, self.cfg.stream_maxlen)

    def consumer(self, spec: StreamSpec[M], group: str, consumer: str) -> Consumer[M]:
        return Consumer(
            self.client, self.key(spec.name), spec, group, consumer,
            dead_letter_key=self.key(DEAD_LETTER), seen_key=self.key(f"seen:{spec.name}:{group}"),
            cfg=self.cfg,
        )

    def credits(self, limit: int) -> PromptCredits:
        return PromptCredits(self.client, self.key("credits"), limit)

    def stats(self, spec: StreamSpec, group: str) -> StreamStats:
        return stream_stats(self.client, self.key(spec.name), group, spec.work_queue)

    def dead_letters(self, count: int = 100) -> list[DeadLetter]:
        """The oldest `count` dead-lettered entries of the run."""
        entries = self.client.xrange(self.key(DEAD_LETTER), count=count)
        return [_dead_letter_from(eid, fields) for eid, fields in entries]


def _dead_letter_from(eid: bytes, f: dict[bytes, bytes]) -> DeadLetter:
    text = lambda k: f.get(k, b"").decode("utf-8", "replace")  # noqa: E731
    return DeadLetter(
        entry_id=eid, stream=text(b"stream"), group=text(b"group"), consumer=text(b"consumer"),
        source_entry_id=text(b"entry_id"), identity=text(b"id"), reason=text(b"reason"),
        deliveries=int(f.get(b"deliveries", 0)), payload=f.get(b"payload", b""), at=float(f.get(b"at", 0)),
    )

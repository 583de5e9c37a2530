"""The Redis client every service uses: reconnects with back-off while Redis restarts or fails over, never
retries a refused password, and returns bytes (payloads are binary).

With `redis.sentinel` the client asks the sentinels for the primary on every (re)connection (redis-py's
`SentinelConnectionPool`, with `_FollowPrimary` connections): a connection lost in a failover is retried, and
each retry asks again, so no service keeps dialing a dead address; a primary that was demoted answers writes
with READONLY, which the pool also turns into a reconnect. `ReplicaWait` is the learner's WAIT after its
critical writes.
"""

from __future__ import annotations

import logging

import redis
from redis.backoff import ExponentialWithJitterBackoff, NoBackoff
from redis.retry import Retry
from redis.sentinel import Sentinel, SentinelManagedConnection

from asyncrlhf.config import RedisConfig

log = logging.getLogger("asyncrlhf.streams")
SENTINEL_TIMEOUT_S = 2.0  # a sentinel that does not answer within this is skipped; the next one is asked


class _Reconnect(Retry):
    """Retries lost connections, never a refused password: redis-py's AuthenticationError is a
    ConnectionError, and a service retrying it forever would hang silently instead of saying why."""

    def call_with_retry(self, do, fail, is_retryable=None, with_failure_count=False):
        def retryable(err: Exception) -> bool:
            refused = isinstance(err, redis.AuthenticationError)
            return not refused and (is_retryable is None or is_retryable(err))

        return super().call_with_retry(do, fail, retryable, with_failure_count)


def connect(cfg: RedisConfig, url: str | None = None, *, retries: int = -1,
            timeout_s: float | None = None) -> redis.Redis:
    """A client for `url` (default `cfg.url`, else the primary that `cfg.sentinel` names) that reconnects
    with jittered exponential back-off, capped at `cfg.reconnect_max_s`, on connection errors; `retries=-1`
    keeps trying, as a service should while Redis restarts or fails over. A wrong or missing password fails
    at once. Responses are bytes (payloads are binary). `timeout_s`: a command (or a connection attempt)
    that gets no answer within it raises `redis.TimeoutError` (a stall monitor's client: a Redis that does not
    answer is what it reports); None waits as long as the server takes."""
    url = url or cfg.url
    kwargs: dict = {
        "retry": _Reconnect(ExponentialWithJitterBackoff(cap=cfg.reconnect_max_s, base=0.05), retries),
        "retry_on_error": [redis.ConnectionError, redis.TimeoutError],
        "socket_keepalive": True,
        "health_check_interval": 30,
    }
    if timeout_s is not None:
        kwargs.update(socket_timeout=timeout_s, socket_connect_timeout=timeout_s)
    if not url and cfg.sentinel.enabled:
        return _via_sentinels(cfg, kwargs)
    if not url:
        raise ValueError(
            "redis.url is not set: pass redis.url=redis://host:6379/0 (or "
            "redis.sentinel.addresses=[HOST:PORT]), or start an embedded server with "
            "asyncrlhf.redis_server.EmbeddedRedis (what `asyncrlhf up` does)"
        )
    if cfg.password and "@" not in url:
        kwargs["password"] = cfg.password
    if url.startswith("rediss://") and cfg.tls_ca_certs:
        kwargs["ssl_ca_certs"] = cfg.tls_ca_certs
    return redis.Redis.from_url(url, **kwargs)


class _FollowPrimary(SentinelManagedConnection):
    """A connection to the sentinels' primary that asks them for it at every reconnection. redis-py (8.1)
    re-opens a dropped connection through `connect_check_health`, which dials the address the connection
    had, so a client blocked in XREADGROUP when the primary died would retry the dead address for ever
    (redis/redis-py#3874); here each attempt asks the sentinels first and dials once, and the command's own
    retry (back-off, `redis.reconnect_max_s`) repeats the lookup until a primary answers."""

    def connect_check_health(self, check_health: bool = True, retry_socket_connect: bool = True) -> None:
        if self._sock is None and self.connection_pool.is_master:
            self.host, self.port = self.connection_pool.get_master_address()
        super().connect_check_health(check_health=check_health, retry_socket_connect=False)


def _via_sentinels(cfg: RedisConfig, kwargs: dict) -> redis.Redis:
    """The primary of `cfg.sentinel.master`, found through the sentinels at each (re)connection. A sentinel
    query does not retry: a dead sentinel is skipped at once and the next one asked; the connection's own
    retry (`kwargs`) repeats the whole lookup while no sentinel knows a primary (mid-failover)."""
    sc = cfg.sentinel
    sentinel_kwargs = {"password": sc.password, "socket_timeout": SENTINEL_TIMEOUT_S,
                       "socket_connect_timeout": SENTINEL_TIMEOUT_S, "retry": Retry(NoBackoff(), 0)}
    sentinels = Sentinel(sc.hosts, sentinel_kwargs=sentinel_kwargs)
    return sentinels.master_for(sc.master, password=cfg.password, db=sc.db, connection_class=_FollowPrimary,
                                **kwargs)


class ReplicaWait:
    """`WAIT wait_replicas wait_timeout_ms` after the learner's critical writes (with `redis.sentinel`), so
    that what it acknowledged survives the loss of the primary: Redis replicates asynchronously, and a
    failover promotes a replica that may lack the newest writes (docs/guarantees.md, "Redis durability").

    WAIT counts replicas that acknowledged the last write *of its connection*, and a pooled client may write
    on one connection and wait on another; so each wait first writes `marker_key` on the connection that
    waits, which covers every earlier write of any connection. Fewer replicas than asked is logged as a
    warning with the count, never ignored: the write stands, but a failover now could lose it."""

    def __init__(self, client: redis.Redis, cfg: RedisConfig, marker_key: str):
        self.client, self.marker_key = client, marker_key
        self.replicas = cfg.sentinel.wait_replicas if cfg.sentinel.enabled else 0
        self.timeout_ms = cfg.sentinel.wait_timeout_ms
        self.short = 0  # waits that ended with fewer replicas than asked

    def __call__(self, what: str) -> int | None:
        """Wait for the replicas to hold everything written so far (`what`: for the log); how many did, or
        None when no wait is configured."""
        if not self.replicas:
            return None
        pipe = self.client.pipeline(transaction=False)
        pipe.set(self.marker_key, what)
        pipe.execute_command("WAIT", self.replicas, self.timeout_ms)
        acked = int(pipe.execute()[-1])
        if acked < self.replicas:
            self.short += 1
            log.warning("Redis WAIT after %s: %d of %d replicas acknowledged within %d ms; a failover now "
                        "could lose these writes (redis.sentinel.wait_replicas)", what, acked, self.replicas,
                        self.timeout_ms)
        return acked

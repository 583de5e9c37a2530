"""The Redis client every service uses: reconnects with back-off while Redis restarts, never retries a refused
password, and returns bytes (payloads are binary)."""

from __future__ import annotations

import redis
from redis.backoff import ExponentialWithJitterBackoff
from redis.retry import Retry

from asyncrlhf.config import RedisConfig


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

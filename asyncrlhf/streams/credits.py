"""The learner's bound on prompt groups in flight, kept in Redis so it survives a learner restart."""

from __future__ import annotations

import redis


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

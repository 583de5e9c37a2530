"""A run on configs/tiny.yaml as separate processes that a test can SIGKILL, SIGSTOP and restart one by one:
an embedded Redis with its append-only file in the run directory, reward replicas, generators and the
learner (`python -m services.<kind>`), each logging to `<run dir>/logs/<name>.log`, plus the real
`asyncrlhf audit` CLI. The learner trains until the test stops it (`learner.total_steps` is large)."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import TypeVar

import httpx
from prometheus_client.parser import text_string_to_metric_families

from asyncrlhf.config import load_config
from asyncrlhf.consumed import Kind, read_rows, rows_of
from asyncrlhf.redis_server import EmbeddedRedis, free_port
from asyncrlhf.training.checkpoint import latest_version

ROOT = Path(__file__).resolve().parents[3]
T = TypeVar("T")

# Short timeouts so faults are noticed in seconds: entries pending on a dead consumer are re-claimed after
# 1 s, a silent generator leaves the registry after 6 s, a push to a stalled one gives up after 2 s.
FAST = [
    "redis.claim_idle_ms=1000",
    "redis.block_ms=200",
    "redis.reconnect_max_s=1",
    "generator.heartbeat_s=0.5",
    "generator.registry_ttl_s=6",
    "learner.push_timeout_s=2",
    "learner.total_steps=100000",
    "learner.checkpoint_every=3",
    "generator.device=cpu",
    "generator.threads=1",
    "learner.threads=1",
]


@dataclass
class Proc:
    name: str
    kind: str
    argv: list[str]
    log_path: Path
    http_port: int
    popen: subprocess.Popen | None = None

    def start(self) -> Proc:
        env = {
            **os.environ,
            "PYTHONPATH": str(ROOT),
            "OMP_NUM_THREADS": "1",
            "TOKENIZERS_PARALLELISM": "false",
        }
        with self.log_path.open("ab") as log:
            self.popen = subprocess.Popen(
                self.argv, cwd=ROOT, env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True
            )
        return self

    @property
    def alive(self) -> bool:
        return self.popen is not None and self.popen.poll() is None

    def signal(self, sig: int) -> None:
        if self.alive:
            os.killpg(self.popen.pid, sig)

    def kill(self) -> None:
        self.signal(signal.SIGKILL)
        if self.popen is not None:
            self.popen.wait(30)

    def stop(self, timeout_s: float = 60) -> int | None:
        """SIGCONT (in case it is stopped), SIGTERM, then SIGKILL after `timeout_s`."""
        if self.popen is None:
            return None
        self.signal(signal.SIGCONT)
        self.signal(signal.SIGTERM)
        try:
            return self.popen.wait(timeout_s)
        except subprocess.TimeoutExpired:
            self.kill()
            return self.popen.returncode

    def log_tail(self, lines: int = 30) -> str:
        text = self.log_path.read_text(errors="replace") if self.log_path.exists() else ""
        return "\n".join(text.splitlines()[-lines:])

    def metrics(self) -> dict[str, float]:
        """This process's /metrics: `name` or `name{k=v,...}` -> value ({} if it does not answer)."""
        try:
            text = httpx.get(f"http://127.0.0.1:{self.http_port}/metrics", timeout=5).text
        except httpx.HTTPError:
            return {}
        out = {}
        for family in text_string_to_metric_families(text):
            for s in family.samples:
                labels = ",".join(f"{k}={v}" for k, v in sorted(s.labels.items()))
                out[f"{s.name}{{{labels}}}" if labels else s.name] = s.value
        return out


class Cluster:
    def __init__(self, tmp_path: Path, *overrides: str, redis_password: str | None = None):
        self.run = f"rel-{uuid.uuid4().hex[:8]}"
        self.dir = tmp_path / "run"
        (self.dir / "logs").mkdir(parents=True, exist_ok=True)
        self.redis = EmbeddedRedis(self.dir / "redis", password=redis_password).start()
        self.overrides = [
            f"run.name={self.run}",
            f"run.dir={self.dir}",
            f"redis.url={self.redis.url}",
            *FAST,
            *overrides,
        ]
        self.cfg = load_config([ROOT / "configs/tiny.yaml"], self.overrides)
        # what `asyncrlhf up` writes, so `asyncrlhf audit RUN_DIR` finds the run's config
        (self.dir / "config.yaml").write_text(self.cfg.to_yaml())
        self.procs: dict[str, Proc] = {}

    # -- processes ---------------------------------------------------------------------------------------

    def start(self, name: str, *extra: str) -> Proc:
        """Start (or restart, same name and port) service `name`: `learner`, `generator-0`, `reward-1`..."""
        kind = name.split("-")[0]
        old = self.procs.get(name)
        port = old.http_port if old else free_port()
        argv = [
            sys.executable,
            "-m",
            f"services.{kind}",
            "--config",
            "configs/tiny.yaml",
            *self.overrides,
            f"{kind}.http_port={port}",
            *extra,
        ]
        proc = Proc(name, kind, argv, self.dir / "logs" / f"{name}.log", port).start()
        self.procs[name] = proc
        return proc

    def start_all(self, generators: int = 2, rewards: int = 2) -> None:
        for i in range(rewards):
            self.start(f"reward-{i}")
        for i in range(generators):
            self.start(f"generator-{i}")
        self.start("learner")

    def check_alive(self, *except_: str) -> None:
        dead = [p for n, p in self.procs.items() if n not in except_ and not p.alive]
        if dead:
            raise AssertionError(
                "\n\n".join(f"{p.name} exited with {p.popen.returncode}:\n{p.log_tail()}" for p in dead)
            )

    def close(self) -> None:
        for proc in sorted(self.procs.values(), key=lambda p: p.kind != "learner"):
            proc.stop(timeout_s=60 if proc.kind == "learner" else 15)
        self.redis.stop()

    # -- what the run did --------------------------------------------------------------------------------

    def consumed(self) -> list[dict]:
        return read_rows(self.dir)

    def steps(self) -> int:
        """Optimizer steps recorded in the consumed log (over restarts)."""
        return len(rows_of(self.dir, Kind.TRAINED))

    def latest_version(self) -> int | None:
        """The policy version of the run's newest checkpoint, None before the first."""
        return latest_version(self.cfg)

    def wait(
        self, condition: Callable[[], T], what: str, timeout_s: float = 240, allow_dead: tuple = ()
    ) -> T:
        deadline = time.monotonic() + timeout_s
        while True:
            self.check_alive(*allow_dead)
            value = condition()
            if value:
                return value
            if time.monotonic() > deadline:
                tails = "\n\n".join(f"--- {p.name}\n{p.log_tail(15)}" for p in self.procs.values())
                raise AssertionError(f"timed out after {timeout_s}s waiting for {what}\n{tails}")
            time.sleep(0.2)

    def wait_steps(self, more: int, what: str = "", **kw) -> int:
        target = self.steps() + more
        self.wait(lambda: self.steps() >= target, f"{more} more training steps {what}".strip(), **kw)
        return target

    def audit(self, *extra: str) -> dict:
        """`asyncrlhf audit RUN_DIR redis.url=... --json` as a user runs it; fails the test unless it is 0."""
        cmd = [
            sys.executable,
            "-m",
            "asyncrlhf.cli",
            "audit",
            str(self.dir),
            f"redis.url={self.redis.url}",
            *extra,
            "--json",
        ]
        done = subprocess.run(
            cmd,
            cwd=ROOT,
            capture_output=True,
            text=True,
            timeout=120,
            env={**os.environ, "PYTHONPATH": str(ROOT)},
        )
        assert done.returncode == 0, f"audit failed ({done.returncode}):\n{done.stdout}\n{done.stderr}"
        return json.loads(done.stdout)

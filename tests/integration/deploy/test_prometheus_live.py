"""A real Prometheus (Debian's binary) scrapes the services of a tiny run through deploy/prometheus's scrape
config and alert rules; after a few learner steps every PromQL expression of the Grafana dashboard returns
data, and so does the signal under every alert.

Alerts fire only when something is wrong, so in a healthy run their expressions are rightly empty. Each is
written `<signal> <comparison> <threshold>` and the test evaluates `<signal>` (the expression up to its
top-level comparison): it must return series, so a renamed metric or label cannot silently disable an alert.
Prometheus must also report every rule as evaluated without error.

The services run as subprocesses on the tiny config (`python -m services.<name>`) against the session's
embedded Redis; the evaluator joins when its package has an entry point.
"""

from __future__ import annotations

import math
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest
import yaml

from asyncrlhf import metrics as names
from asyncrlhf.redis_server import free_port
from tests.unit.deploy.helpers import (
    ALERTS,
    DEPLOY,
    ROOT,
    alert_rules,
    alert_signal,
    dashboard_queries,
    metric_names,
)

pytestmark = [
    pytest.mark.integration,
    pytest.mark.skipif(
        shutil.which("prometheus") is None,
        reason="needs prometheus (apt-get install prometheus; .ci/run does)",
    ),
]
STEPS = 3  # learner steps before the expressions are evaluated
START_TIMEOUT_S = 420


class Stack:
    def __init__(self, tmp: Path, redis_url: str, run_name: str):
        self.tmp, self.procs, self.logs = tmp, {}, {}
        self.services = ["generator", "reward", "learner"]
        if (ROOT / "services" / "evaluator" / "__main__.py").exists():
            self.services.append("evaluator")
        self.ports = {name: free_port() for name in self.services}
        self.overrides = [
            f"redis.url={redis_url}",
            f"run.name={run_name}",
            f"run.dir={tmp}/run",
            "learner.total_steps=1000",
            "learner.checkpoint_every=2",
            "redis.block_ms=100",
            f"generator.grpc_port={free_port()}",
            *(f"{name}.http_port={port}" for name, port in self.ports.items()),
        ]
        self.prometheus_url = f"http://127.0.0.1:{free_port()}"

    def start(self) -> Stack:
        env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"}
        for name in self.services:
            self._spawn(
                name,
                [sys.executable, "-m", f"services.{name}", "--config", "configs/tiny.yaml", *self.overrides],
                env,
            )
        config = self._prometheus_config()
        self._spawn(
            "prometheus",
            [
                "prometheus",
                f"--config.file={config}",
                f"--storage.tsdb.path={self.tmp}/tsdb",
                f"--web.listen-address={self.prometheus_url.removeprefix('http://')}",
            ],
            env,
        )
        return self

    def _spawn(self, name: str, args: list[str], env: dict) -> None:
        self.logs[name] = self.tmp / f"{name}.log"
        self.procs[name] = subprocess.Popen(
            args, cwd=ROOT, env=env, stdout=self.logs[name].open("w"), stderr=subprocess.STDOUT
        )

    def _prometheus_config(self) -> Path:
        """deploy/prometheus/prometheus.yml with loopback targets and 1 s intervals, beside alerts.yml."""
        config = yaml.safe_load((DEPLOY / "prometheus" / "prometheus.yml").read_text())
        config["global"].update(scrape_interval="1s", evaluation_interval="1s")
        jobs = []
        for job in config["scrape_configs"]:
            static = job["static_configs"][0]
            service = static.get("labels", {}).get("service")
            if service in self.ports:
                static["targets"] = [f"127.0.0.1:{self.ports[service]}"]
            elif service is None:
                static["targets"] = [self.prometheus_url.removeprefix("http://")]
            else:
                continue
            jobs.append(job)
        config["scrape_configs"] = jobs
        shutil.copy(ALERTS, self.tmp / "alerts.yml")
        path = self.tmp / "prometheus.yml"
        path.write_text(yaml.safe_dump(config))
        return path

    def query(self, expr: str) -> list[dict]:
        reply = httpx.get(f"{self.prometheus_url}/api/v1/query", params={"query": expr}, timeout=10).json()
        assert reply["status"] == "success", f"{expr}: {reply}"
        return reply["data"]["result"]

    def check_alive(self) -> None:
        for name, proc in self.procs.items():
            if proc.poll() is not None:
                pytest.fail(f"{name} exited with {proc.returncode}:\n{self.log_tail(name)}")

    def log_tail(self, name: str) -> str:
        return self.logs[name].read_text()[-3000:]

    def wait_for_steps(self, steps: int) -> None:
        deadline = time.monotonic() + START_TIMEOUT_S
        while time.monotonic() < deadline:
            self.check_alive()
            try:  # Prometheus answers 503 until its storage is ready (a fresh install takes longer)
                ready = httpx.get(f"{self.prometheus_url}/-/ready", timeout=10).status_code == 200
                if ready and self.query(f"max({names.LEARNER_STEPS_TOTAL}) >= {steps}"):
                    return
            except httpx.HTTPError:
                pass  # Prometheus still starting
            time.sleep(1)
        logs = "\n".join(f"--- {n}\n{self.log_tail(n)}" for n in self.procs)
        pytest.fail(f"the learner did not take {steps} steps in {START_TIMEOUT_S}s\n{logs}")

    def stop(self) -> None:
        for proc in self.procs.values():
            if proc.poll() is None:
                proc.terminate()
        for proc in self.procs.values():
            try:
                proc.wait(timeout=15)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()


@pytest.fixture(scope="module")
def stack(tmp_path_factory, redis_url):
    tmp = tmp_path_factory.mktemp("deploy-live")
    live = Stack(tmp, redis_url, f"deploy-live-{os.getpid()}").start()
    try:
        live.wait_for_steps(STEPS)
        time.sleep(3)  # a few more scrapes, so every rate() window holds several samples
        yield live
    finally:
        live.stop()


def skip_unless_running(stack: Stack, expr: str) -> None:
    for name in metric_names(expr):
        service = name.split("_")[1]
        if service not in stack.services:
            pytest.skip(f"services.{service} has no entry point yet, so nothing exports {name}")


def assert_returns_data(stack: Stack, where: str, expr: str) -> None:
    result = stack.query(expr)
    assert result, f"{where} shows no data: {expr}"
    values = [float(series["value"][1]) for series in result]
    assert any(not math.isnan(v) for v in values), f"{where} shows only NaN: {expr} -> {result}"


@pytest.mark.parametrize("query", dashboard_queries(), ids=lambda q: q.where)
def test_dashboard_expression_returns_data(stack, query):
    skip_unless_running(stack, query.expr)
    assert_returns_data(stack, query.where, query.expr)


@pytest.mark.parametrize("rule", alert_rules(), ids=lambda r: r["alert"])
def test_alert_signal_returns_data(stack, rule):
    signal = alert_signal(rule["expr"])
    skip_unless_running(stack, signal)
    assert_returns_data(stack, f"alert `{rule['alert']}`", signal)


def test_prometheus_evaluates_every_rule_without_error_and_scrapes_every_service(stack):
    rules = httpx.get(f"{stack.prometheus_url}/api/v1/rules", timeout=10).json()["data"]["groups"]
    loaded = {r["name"]: r for group in rules for r in group["rules"]}
    assert set(loaded) == {r["alert"] for r in alert_rules()}
    for name, rule in loaded.items():
        assert rule["health"] == "ok", f"{name}: {rule.get('lastError')}"
    up = {s["metric"]["service"]: s["value"][1] for s in stack.query('up{service!=""}')}
    assert up == {name: "1" for name in stack.services}

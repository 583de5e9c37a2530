"""Metric naming and the HTTP app every service shares (`/healthz`, `/readyz`, `/metrics`).

Names follow `asyncrlhf_<service>_<what>_<unit>`, `_total` for counters, `_seconds` / `_bytes` units.
Each service declares its metrics in its own package (`services/<name>/metrics.py`) with `metric_name`,
in a `CollectorRegistry` of its own: no process-global state, so tests can run several services in one
process.
"""

from __future__ import annotations

import re
from typing import Callable

from fastapi import FastAPI, Response
from fastapi.responses import JSONResponse
from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, generate_latest

PREFIX = "asyncrlhf"
SERVICES = ("generator", "reward", "learner", "evaluator", "launcher")
_PART = re.compile(r"^[a-z][a-z0-9_]*$")


def metric_name(service: str, what: str, unit: str | None = None) -> str:
    """`metric_name("generator", "tokens", "total")` -> `asyncrlhf_generator_tokens_total`."""
    if service not in SERVICES:
        raise ValueError(f"unknown service `{service}`; one of {SERVICES}")
    parts = [PREFIX, service, what] + ([unit] if unit else [])
    for part in parts[2:]:
        if not _PART.match(part):
            raise ValueError(f"metric name part `{part}` must be lower_snake_case")
    return "_".join(parts)


def make_app(
    service: str,
    registry: CollectorRegistry,
    ready: Callable[[], tuple[bool, str]] = lambda: (True, "ok"),
    **fastapi_kwargs,
) -> FastAPI:
    """A FastAPI app with the three routes every service has; the service adds its own routes to it.

    `ready()` returns (ready, reason): `/readyz` answers 200 or 503 with the reason.
    """
    app = FastAPI(title=f"asyncrlhf {service}", **fastapi_kwargs)

    @app.get("/healthz", summary="The process is alive.")
    def healthz() -> dict:
        return {"status": "ok", "service": service}

    @app.get("/readyz", summary="The service can do its work (model loaded, Redis reachable).")
    def readyz() -> JSONResponse:
        try:
            ok, reason = ready()
        except Exception as err:  # a readiness probe must answer, not crash
            ok, reason = False, f"{type(err).__name__}: {err}"
        return JSONResponse({"ready": ok, "reason": reason, "service": service}, status_code=200 if ok else 503)

    @app.get("/metrics", summary="Prometheus metrics.")
    def metrics() -> Response:
        return Response(generate_latest(registry), media_type=CONTENT_TYPE_LATEST)

    return app

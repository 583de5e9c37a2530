import httpx
import pytest
from fastapi import Depends
from prometheus_client import CollectorRegistry, Counter

from asyncrlhf.config import load_config
from asyncrlhf.metrics import make_app, metric_name
from asyncrlhf.service import HttpServer, ServiceError, check_bind, load_service_config, token_dependency

pytestmark = pytest.mark.unit


def test_metric_names_follow_the_convention():
    assert metric_name("generator", "tokens", "total") == "asyncrlhf_generator_tokens_total"
    with pytest.raises(ValueError, match="unknown service"):
        metric_name("gen", "tokens")
    with pytest.raises(ValueError, match="lower_snake_case"):
        metric_name("learner", "Loss")


def test_shared_app_serves_health_readiness_metrics_and_guards_mutations():
    registry = CollectorRegistry()
    Counter(metric_name("reward", "groups", "total"), "groups", registry=registry).inc(3)
    state = {"ready": (False, "model loading")}
    app = make_app("reward", registry, ready=lambda: state["ready"])

    @app.post("/mutate", dependencies=[Depends(token_dependency("t0k"))])
    def mutate() -> dict:
        return {"ok": True}

    server = HttpServer(app, "127.0.0.1", 0).start()
    try:
        with httpx.Client(base_url=server.url, timeout=5) as http:
            for _ in range(50):
                try:
                    assert http.get("/healthz").json()["status"] == "ok"
                    break
                except httpx.TransportError:
                    import time

                    time.sleep(0.1)
            not_ready = http.get("/readyz")
            assert not_ready.status_code == 503 and not_ready.json()["reason"] == "model loading"
            state["ready"] = (True, "ok")
            assert http.get("/readyz").status_code == 200
            assert "asyncrlhf_reward_groups_total 3.0" in http.get("/metrics").text
            assert http.post("/mutate").status_code == 401
            assert http.post("/mutate", headers={"Authorization": "Bearer nope"}).status_code == 401
            assert http.post("/mutate", headers={"Authorization": "Bearer t0k"}).json() == {"ok": True}
    finally:
        server.stop()


def test_non_loopback_bind_needs_a_token_or_explicit_permission():
    check_bind("127.0.0.1", load_config(), "generator gRPC")
    check_bind("::1", load_config(), "generator gRPC")
    with pytest.raises(ServiceError, match="no auth token"):
        check_bind("0.0.0.0", load_config(), "generator gRPC")
    check_bind("0.0.0.0", load_config([], ["run.token=x"]), "generator gRPC")
    check_bind("0.0.0.0", load_config([], ["run.allow_insecure_bind=true"]), "generator gRPC")


def test_service_args_take_config_flags_and_overrides():
    cfg = load_service_config(["--config", "configs/tiny.yaml", "learner.lr=3e-6", "--run.name", "x"])
    assert (cfg.learner.lr, cfg.run.name, cfg.model.name_or_path) == (3e-6, "x", "tiny")

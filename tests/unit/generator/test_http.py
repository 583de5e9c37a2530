import pytest
from fastapi.testclient import TestClient

from asyncrlhf.config import load_config
from asyncrlhf.models import load_policy, load_tokenizer
from asyncrlhf.sampling.hf import HFBackend
from services.generator.gate import BackendGate
from services.generator.http import make_http_app
from services.generator.metrics import GeneratorMetrics

pytestmark = pytest.mark.unit


@pytest.fixture(scope="module")
def app_and_backend():
    cfg = load_config(["configs/tiny.yaml"], ["generator.device=cpu", "run.token=s3cret"])
    tokenizer = load_tokenizer(cfg.model)
    backend = HFBackend.from_config(cfg, tokenizer)
    app = make_http_app(cfg, GeneratorMetrics("gen-t"), backend, BackendGate(), tokenizer, "gen-t",
                        ready=lambda: (backend.version > 0, "ok" if backend.version else "no weights"))
    return TestClient(app, headers={"Authorization": "Bearer s3cret"}), backend, cfg


@pytest.mark.parametrize("body, reason", [
    ({}, "prompt"),
    ({"prompt": ""}, "must not be empty"),
    ({"prompt": []}, "give 1 to"),
    ({"prompt": "hi", "temperature": 0}, "greater than or equal to 0.001"),
    ({"prompt": "hi", "top_p": 1.5}, "less than or equal to 1"),
    ({"prompt": "hi", "n": 0}, "greater than or equal to 1"),
    ({"prompt": "hi", "max_tokens": "many"}, "valid integer"),
    ({"prompt": "hi", "best_of": 2}, "Extra inputs are not permitted"),
])
def test_invalid_requests_get_422_with_the_reason(app_and_backend, body, reason):
    client, _, _ = app_and_backend
    reply = client.post("/v1/completions", json=body)
    assert reply.status_code == 422 and reason in reply.text


def test_no_weights_yet_is_503_then_completions_carry_the_version(app_and_backend):
    client, backend, cfg = app_and_backend
    assert client.get("/readyz").status_code == 503
    assert client.post("/v1/completions", json={"prompt": "hi"}).status_code == 503
    backend.apply_weights(load_policy(cfg.model).state_dict(), version=7)
    assert client.get("/readyz").status_code == 200
    reply = client.post("/v1/completions", json={"prompt": "hi", "n": 3, "max_tokens": 4})
    assert reply.status_code == 200, reply.text
    body = reply.json()
    assert body["policy_version"] == 7 and len(body["choices"]) == 3
    assert all(c["logprobs"] is None and c["finish_reason"] in ("stop", "length") for c in body["choices"])
    assert body["usage"]["completion_tokens"] <= 12
    assert TestClient(client.app).post("/v1/completions", json={"prompt": "hi"}).status_code == 401

import pytest
from fastapi.testclient import TestClient

from asyncrlhf.config import load_config
from asyncrlhf.models import load_policy, load_tokenizer
from asyncrlhf.sampling.hf import HFBackend
from asyncrlhf.serving.gate import BackendGate
from asyncrlhf.version import PolicyVersion
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


@pytest.mark.parametrize("body, param, reason", [
    ({"model": "tiny"}, "prompt", "prompt: Field required"),
    ({"model": "tiny", "prompt": ""}, "prompt", "must not be empty"),
    ({"model": "tiny", "prompt": []}, "prompt", "give 1 to"),
    ({"model": "tiny", "prompt": "hi", "temperature": -0.1}, "temperature", "greater than or equal to 0"),
    ({"model": "tiny", "prompt": "hi", "top_p": 1.5}, "top_p", "less than or equal to 1"),
    ({"model": "tiny", "prompt": "hi", "n": 0}, "n", "greater than or equal to 1"),
    ({"model": "tiny", "prompt": "hi", "max_tokens": "many"}, "max_tokens", "valid integer"),
    ({"model": "tiny", "prompt": "hi", "stop": ["a", "b", "c", "d", "e"]}, "stop", "at most 4"),
    ({"model": "tiny", "prompt": "hi", "stream_options": {"include_usage": True}}, None, "only allowed with"),
    ({"model": "tiny", "prompt": "hi", "best_of": 2}, "best_of", "unsupported parameter(s): best_of"),
])
def test_invalid_requests_get_400_in_openai_shape_naming_the_parameter(app_and_backend, body, param, reason):
    client, _, _ = app_and_backend
    reply = client.post("/v1/completions", json=body)
    assert reply.status_code == 400, reply.text
    error = reply.json()["error"]
    assert reason in error["message"] and error["type"] == "invalid_request_error"
    assert error["param"] == param


def test_probe_routes_keep_fastapi_errors(app_and_backend):
    client, _, _ = app_and_backend
    assert client.get("/nowhere").json() == {"detail": "Not Found"}


def test_no_weights_yet_is_503_then_completions_carry_the_version(app_and_backend):
    client, backend, cfg = app_and_backend
    assert client.get("/readyz").status_code == 503
    assert client.post("/v1/completions", json={"model": "tiny", "prompt": "hi"}).status_code == 503
    backend.apply_weights(load_policy(cfg.model).state_dict(), version=PolicyVersion(0, 7))
    assert client.get("/readyz").status_code == 200
    reply = client.post("/v1/completions", json={"model": "tiny", "prompt": "hi", "n": 3, "max_tokens": 4})
    assert reply.status_code == 200, reply.text
    body = reply.json()
    assert body["policy_version"] == 7 and len(body["choices"]) == 3
    assert all("logprobs" not in c and c["finish_reason"] in ("stop", "length") for c in body["choices"])
    assert body["usage"]["completion_tokens"] <= 12
    denied = TestClient(client.app).post("/v1/completions", json={"model": "tiny", "prompt": "hi"})
    assert denied.status_code == 401 and denied.json()["error"]["code"] == "invalid_api_key"

"""The HTTP APIs fuzzed from their own OpenAPI schemas (schemathesis): no input gets a 5xx.

Both apps run in-process on their real dependencies: the generator's on the tiny model's HF backend (with
weights, so completions are really sampled), the reward service's on rule scorers. Requests carry the
token, so bodies get past auth; the generator's sample counts are clamped so a case stays cheap (the
limits themselves are the schema's and are fuzzed by validation, not by waiting)."""

from __future__ import annotations

import pytest
import schemathesis
from hypothesis import HealthCheck, settings

from asyncrlhf.config import RewardConfig, RuleScorerConfig, load_config
from asyncrlhf.models import load_policy, load_tokenizer
from asyncrlhf.rewards import build_reward
from asyncrlhf.sampling.hf import HFBackend
from asyncrlhf.serving.gate import BackendGate
from asyncrlhf.version import PolicyVersion
from services.generator.http import make_http_app
from services.generator.metrics import GeneratorMetrics
from services.reward.http import ServingState, create_app
from services.reward.metrics import RewardMetrics

pytestmark = pytest.mark.integration
TOKEN = "s3cret"
AUTH = {"Authorization": f"Bearer {TOKEN}"}
FUZZ = settings(max_examples=25, deadline=None, derandomize=True, suppress_health_check=list(HealthCheck))


def generator_app():
    cfg = load_config(["configs/tiny.yaml"], ["generator.device=cpu", f"run.token={TOKEN}"])
    tokenizer = load_tokenizer(cfg.model)
    backend = HFBackend.from_config(cfg, tokenizer)
    backend.apply_weights(load_policy(cfg.model).state_dict(), version=PolicyVersion(0, 1))
    return make_http_app(
        cfg,
        GeneratorMetrics("gen-fuzz"),
        backend,
        BackendGate(),
        tokenizer,
        "gen-fuzz",
        ready=lambda: (True, "ok"),
    )


def reward_app():
    cfg = RewardConfig(
        scorers=[
            RuleScorerConfig(name="sentiment"),
            RuleScorerConfig(name="exact_match", weight=0.5),
        ],
        max_request_items=8,
    )
    state = ServingState()
    state.set_ready(build_reward(cfg), lambda: True)
    return create_app(state, RewardMetrics(), token=TOKEN, max_items=cfg.max_request_items)


generator_schema = schemathesis.openapi.from_asgi("/openapi.json", generator_app())
reward_schema = schemathesis.openapi.from_asgi("/openapi.json", reward_app())


def clamp_cost(case) -> None:
    """At most 2 prompts x 2 samples x 4 tokens per generator case."""
    body = case.body
    if isinstance(body, dict):
        for key, most in (("n", 2), ("max_tokens", 4)):
            if isinstance(body.get(key), int) and not isinstance(body[key], bool) and body[key] > most:
                body[key] = most
        if isinstance(body.get("prompt"), list) and len(body["prompt"]) > 2:
            body["prompt"] = body["prompt"][:2]


def assert_no_server_error(case) -> None:
    response = case.call(headers=AUTH, timeout=120)
    assert response.status_code < 500, (
        f"{case.method} {case.path} -> {response.status_code}: {response.text[:500]}\nbody: {case.body!r}"
    )


@generator_schema.parametrize()
@FUZZ
def test_generator_http_api_never_answers_5xx(case):
    clamp_cost(case)
    assert_no_server_error(case)


@reward_schema.parametrize()
@FUZZ
def test_reward_http_api_never_answers_5xx(case):
    assert_no_server_error(case)

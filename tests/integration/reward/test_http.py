"""The HTTP scoring API on a real socket: our schema, OpenRLHF's protocol, limits, auth."""

import httpx
import pytest
import requests

from asyncrlhf import metrics as names
from asyncrlhf.config import RewardConfig, RuleScorerConfig
from asyncrlhf.rewards import build_reward
from asyncrlhf.rewards.remote import RemoteScorer
from asyncrlhf.service import HttpServer
from services.reward import http as reward_http
from services.reward.http import ServingState, create_app
from services.reward.metrics import RewardMetrics
from tests.integration.reward.helpers import wait_for

pytestmark = pytest.mark.integration

POSITIVE, NEGATIVE = " I love it, wonderful!", " This is awful."


def vader(text):
    from vaderSentiment.vaderSentiment import SentimentIntensityAnalyzer

    return SentimentIntensityAnalyzer().polarity_scores(text)["compound"]


@pytest.fixture
def served(request):
    """A reward HTTP server on a free port: sentiment (weight 1) + exact_match (weight 0.5); max 4 items."""
    token = getattr(request, "param", None)
    cfg = RewardConfig(
        scorers=[
            RuleScorerConfig(name="sentiment"),
            RuleScorerConfig(name="exact_match", weight=0.5),
        ],
        missing_eos_penalty=-1.0,
        max_request_items=4,
    )
    state, metrics = ServingState(), RewardMetrics()
    server = HttpServer(
        create_app(state, metrics, token=token, max_items=cfg.max_request_items), "127.0.0.1", 0
    ).start()
    wait_for(lambda: _up(server.url), 10, "the HTTP server")
    assert requests.get(server.url + "/readyz", timeout=5).status_code == 503  # scorers not loaded yet
    state.set_ready(build_reward(cfg), lambda: True)
    yield server.url, metrics
    server.stop()


def _up(url):
    try:
        return requests.get(url + "/healthz", timeout=1).status_code == 200
    except requests.ConnectionError:
        return False


def openrlhf_post(url, data):
    """What OpenRLHF's `request_api_wrapper` does, verbatim in effect."""
    response = requests.post(url=url, json=data, headers={"Content-Type": "application/json"}, timeout=180)
    response.raise_for_status()
    return response.json()


def test_get_reward_answers_an_openrlhf_client_request(served):
    url, metrics = served
    prompts = ["<s>user\nWhat is 2+2?</s>\n<s>assistant\n", "<s>user\nHow was the film?</s>\n<s>assistant\n"]
    responses = ["4", NEGATIVE]
    data = {
        "query": [p + r for p, r in zip(prompts, responses, strict=True)],
        "prompts": prompts,
        "labels": ["4", ""],
        "datasources": ["math", "chat"],
    }  # newer clients send extra keys: accepted
    body = openrlhf_post(url + "/get_reward", data)
    # item 0: sentiment("4") = 0 + 0.5 * exact_match 1 = 0.5; item 1: vader(NEGATIVE) + 0.5 * 0 (no label)
    assert body["rewards"] == pytest.approx([0.5, vader(NEGATIVE)])
    assert body["scores"] == body["rewards"]
    assert body["extra_logs"]["exact_match"] == [1.0, 0.0]
    # the oldest clients send only `query`: the whole query is then the completion
    assert openrlhf_post(url + "/get_reward", {"query": [POSITIVE]})["rewards"] == pytest.approx(
        [vader(POSITIVE)]
    )
    assert f'{names.REWARD_SAMPLES_SCORED_TOTAL}{{source="http"}} 3.0' in requests.get(url + "/metrics").text
    assert requests.get(url + "/readyz").status_code == 200


def test_our_remote_client_scores_against_our_server(served):
    url, _ = served
    remote = RemoteScorer(url, timeout_s=10, retries=0)
    result = remote.score(["Q: ", "Q: "], [POSITIVE, "7"], ["", "7"])
    assert result.scores == pytest.approx([vader(POSITIVE), 0.5])
    assert result.components["exact_match"] == [0.0, 1.0]
    remote.close()


def test_score_route_applies_the_penalty_and_reports_components(served):
    url, _ = served
    body = httpx.post(
        url + "/score",
        json={
            "items": [
                {"prompt": "p", "completion": POSITIVE},
                {"prompt": "p", "completion": POSITIVE, "finish_reason": "length"},
            ]
        },
    ).json()
    assert body["rewards"] == pytest.approx([vader(POSITIVE), -1.0])
    assert body["components"]["missing_eos"] == [0.0, 1.0] and body["truncated"] == 0


@pytest.mark.parametrize(
    "route,payload,reason",
    [
        ("/get_reward", {}, "query"),
        ("/get_reward", {"query": "not a list"}, "list"),
        ("/get_reward", {"query": []}, "at least 1"),
        ("/get_reward", {"query": ["a", "b"], "prompts": ["a"]}, "`prompts` has 1 entries but `query` has 2"),
        ("/score", {"items": [{"prompt": "p"}]}, "completion"),
        ("/score", {"items": [{"prompt": "p", "completion": "c", "finish_reason": "eos"}]}, "stop"),
        ("/score", {"items": [{"prompt": "p", "completion": "c", "colour": 1}]}, "Extra inputs"),
        ("/score", {"items": [{"prompt": "p", "completion": "c"}] * 5}, "at most 4"),
    ],
)
def test_invalid_input_gets_422_with_a_reason(served, route, payload, reason):
    url, _ = served
    response = httpx.post(url + route, json=payload)
    assert response.status_code == 422
    assert reason in response.text


def test_get_reward_scores_a_batch_over_the_item_limit_in_chunks(served):
    url, _ = served
    texts = [POSITIVE, NEGATIVE, "meh"] * 3  # 9 items, scored 4 + 4 + 1
    body = openrlhf_post(url + "/get_reward", {"query": texts})
    assert body["rewards"] == pytest.approx([vader(t) for t in texts])
    assert body["extra_logs"]["sentiment"] == pytest.approx(body["rewards"])


def test_size_limits(served, monkeypatch):
    url, _ = served
    monkeypatch.setattr(reward_http, "MAX_BODY_BYTES", 100)
    response = httpx.post(url + "/get_reward", json={"query": ["x" * 200]})
    assert response.status_code == 413 and "split the request" in response.text
    chunked = httpx.post(
        url + "/get_reward", content=iter([b'{"query": ["x"]}']), headers={"Content-Type": "application/json"}
    )
    assert chunked.status_code == 411


@pytest.mark.parametrize("served", ["t0k"], indirect=True)
def test_scoring_routes_need_the_token_when_one_is_set(served):
    url, _ = served
    assert httpx.post(url + "/get_reward", json={"query": ["a"]}).status_code == 401
    assert httpx.post(url + "/score", json={"items": [{"prompt": "p", "completion": "c"}]}).status_code == 401
    ok = httpx.post(url + "/get_reward", json={"query": ["a"]}, headers={"Authorization": "Bearer t0k"})
    assert ok.status_code == 200
    assert RemoteScorer(url, retries=0, token="t0k").score(["p"], ["c"]).scores == [0.0]
    assert httpx.get(url + "/metrics").status_code == 200  # read-only routes stay open

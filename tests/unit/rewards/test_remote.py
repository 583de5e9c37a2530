import json

import httpx
import pytest

from asyncrlhf.rewards import ScorerConfigError, ScorerError
from asyncrlhf.rewards.remote import RemoteScorer

pytestmark = pytest.mark.unit


def scorer_with(handler, retries=2, **kwargs):
    return RemoteScorer(
        "http://rm.test:5000",
        retries=retries,
        backoff_s=0.001,
        transport=httpx.MockTransport(handler),
        **kwargs,
    )


def test_sends_openrlhf_request_and_reads_rewards_and_extra_logs():
    seen = []

    def handler(request):
        seen.append((request.url.path, json.loads(request.content), request.headers.get("authorization")))
        return httpx.Response(
            200, json={"rewards": [0.5, -1], "scores": [0.5, -1], "extra_logs": {"acc": [1, 0], "bad": [1]}}
        )

    result = scorer_with(handler, token="s3").score(["Q: ", "Q2: "], ["a", "b"])
    assert result.scores == [0.5, -1.0]
    assert result.components == {"acc": [1.0, 0.0]}  # wrong-length logs are dropped
    assert seen == [
        (
            "/get_reward",
            {"query": ["Q: a", "Q2: b"], "prompts": ["Q: ", "Q2: "], "labels": ["", ""]},
            "Bearer s3",
        )
    ]


def test_retries_transient_failures_then_gives_up():
    calls = []

    def flaky(request):
        calls.append(1)
        if len(calls) == 1:
            raise httpx.ConnectError("refused")
        if len(calls) == 2:
            return httpx.Response(503, text="warming up")
        return httpx.Response(200, json={"rewards": [2.0]})

    assert scorer_with(flaky).score(["p"], ["c"]).scores == [2.0] and len(calls) == 3

    def down(request):
        raise httpx.ReadTimeout("slow")

    with pytest.raises(ScorerError, match="failed 3 times; last error: ReadTimeout"):
        scorer_with(down).score(["p"], ["c"])


def test_client_errors_and_bad_bodies_fail_at_once():
    calls = []

    def bad_request(request):
        calls.append(1)
        return httpx.Response(400, text="no")

    with pytest.raises(ScorerError, match="HTTP 400"):
        scorer_with(bad_request).score(["p"], ["c"])
    assert len(calls) == 1
    with pytest.raises(ScorerError, match="without a `rewards` list"):
        scorer_with(lambda r: httpx.Response(200, json={"score": [1]})).score(["p"], ["c"])
    with pytest.raises(ScorerError, match="returned 2 scores for 1"):
        scorer_with(lambda r: httpx.Response(200, json={"rewards": [1, 2]})).score(["p"], ["c"])
    with pytest.raises(ScorerConfigError, match="http://"):
        RemoteScorer("rm.test:5000")

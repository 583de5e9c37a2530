"""The learner's other nodes: which process serves HTTP there, and what it answers."""

import json
import urllib.request

import pytest

from asyncrlhf.config import load_config
from asyncrlhf.service import ServiceError
from services.learner.follower import leads_a_follower_node, serve_follower_http

pytestmark = pytest.mark.unit


@pytest.mark.parametrize("rank, local_rank, serves", [
    (0, "0", False),  # rank 0 serves the learner's own HTTP
    (3, "0", True),  # first process of the second node of 3 processes each
    (4, "1", False),
    (1, "1", False),  # rank 0's node: one HTTP server per pod is enough
])
def test_the_first_process_of_each_other_node_serves(monkeypatch, rank, local_rank, serves):
    monkeypatch.setenv("LOCAL_RANK", local_rank)
    assert leads_a_follower_node(rank) is serves


def get(url: str) -> tuple[int, str]:
    with urllib.request.urlopen(url, timeout=10) as reply:
        return reply.status, reply.read().decode()


def test_a_follower_answers_the_probes_and_exports_no_learner_series():
    cfg = load_config(["configs/tiny.yaml"], ["learner.http_port=0"])
    http = serve_follower_http(cfg, rank=3, world=6)
    try:
        status, body = get(http.url + "/healthz")
        assert status == 200 and json.loads(body)["status"] == "ok"
        status, body = get(http.url + "/readyz")
        assert status == 200 and json.loads(body) == {
            "ready": True, "reason": "rank 3 of 6, following rank 0", "service": "learner"}
        status, body = get(http.url + "/metrics")
        assert status == 200 and "asyncrlhf_learner" not in body
    finally:
        http.stop()


def test_a_follower_binds_all_interfaces_only_with_a_token(monkeypatch):
    monkeypatch.delenv("ASYNCRLHF_TOKEN", raising=False)
    cfg = load_config(["configs/tiny.yaml"], ["learner.http_host=0.0.0.0", "learner.http_port=0"])
    with pytest.raises(ServiceError, match="no auth token"):
        serve_follower_http(cfg, rank=1, world=2)

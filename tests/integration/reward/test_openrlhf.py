"""OpenRLHF's remote reward-model client against a secured reward service: the `requests` call its
`request_api_wrapper` makes (JSON body, Content-Type header, `raise_for_status`, retried on any error), with
the token in the URL; a whole rollout batch of 4096; queries decoded with special tokens scoring exactly as
the pipeline scores the same samples (chat-templated tiny model, tiny reward model)."""

from __future__ import annotations

import random
import time

import pytest
import requests

from asyncrlhf.config import ModelScorerConfig, RewardConfig, RuleScorerConfig, load_config
from asyncrlhf.models import encode_prompts, load_tokenizer
from asyncrlhf.rewards import Item, build_reward
from asyncrlhf.rewards.openrlhf import QueryReader
from asyncrlhf.rewards.remote import RemoteScorer
from asyncrlhf.service import HttpServer
from services.reward.http import ServingState, create_app
from services.reward.metrics import RewardMetrics

pytestmark = pytest.mark.integration
TOKEN = "t0k"
CFG = load_config(["configs/tiny.yaml"])
WORDS = ["good", "bad", "great", "awful", "film", "the", "I", "love", "it", "hate", "so", "very"]


def openrlhf_request(url: str, data: dict, score_key: str = "rewards", tries: int = 5) -> list[float]:
    """The behaviour of OpenRLHF's `request_api_wrapper`: POST json with a Content-Type header, fail on any
    non-2xx, retry every error after 1 s, give up after `tries`."""
    for _ in range(tries):
        try:
            response = requests.post(url=url, json=data, headers={"Content-Type": "application/json"},
                                     timeout=180)
            response.raise_for_status()
            body = response.json()
            assert score_key in body
            return body[score_key]
        except (requests.RequestException, AssertionError):
            time.sleep(1)
    raise RuntimeError(f"request error {tries} times")


@pytest.fixture(scope="module")
def served():
    tokenizer = load_tokenizer(CFG.model)
    cfg = RewardConfig(scorers=[RuleScorerConfig(name="sentiment"),
                                ModelScorerConfig(path="tiny", weight=0.5)], device="cpu",
                       batch_size=64)
    reward = build_reward(cfg)
    state = ServingState()
    state.set_ready(reward, lambda: True, QueryReader(tokenizer, CFG.model))
    server = HttpServer(create_app(state, RewardMetrics(), token=TOKEN, max_items=cfg.max_request_items),
                        "127.0.0.1", 0).start()
    yield server, reward, tokenizer, state
    server.stop()


def samples(tokenizer, n: int, seed: int = 0):
    """n (raw prompt, completion ids ending in EOS) pairs, and OpenRLHF's query for each: the templated
    prompt and the completion decoded with special tokens, padding included."""
    rng = random.Random(seed)
    raw = [" ".join(rng.choices(WORDS, k=rng.randint(1, 6))) for _ in range(n)]
    prompt_ids = encode_prompts(tokenizer, raw, CFG.model)
    eos, pad = tokenizer.eos_token_id, tokenizer.pad_token_id
    texts = [" " + " ".join(rng.choices(WORDS, k=rng.randint(1, 8))) for _ in range(n)]
    completions = [tokenizer(t, add_special_tokens=False)["input_ids"] + [eos] for t in texts]
    queries = [tokenizer.decode(p + c + [pad] * rng.randint(0, 3), skip_special_tokens=False)
               for p, c in zip(prompt_ids, completions, strict=True)]
    prompts = [tokenizer.decode(p, skip_special_tokens=False) for p in prompt_ids]
    return raw, completions, queries, prompts


def pipeline_scores(reward, tokenizer, raw, completions) -> list[float]:
    """What the reward loop computes for these samples: Item(dataset prompt, completion text)."""
    items = [Item(p, tokenizer.decode(c, skip_special_tokens=True))
             for p, c in zip(raw, completions, strict=True)]
    return reward.score(items).scores


def test_openrlhf_client_with_the_token_in_the_url_scores_a_4096_batch_as_the_pipeline_does(served):
    server, reward, tokenizer, _ = served
    raw, completions, queries, _ = samples(tokenizer, 4096)
    assert "</s>" in queries[0] and queries[0].startswith("<s>user\n")  # special tokens and chat markers
    secured = f"http://openrlhf:{TOKEN}@127.0.0.1:{server.port}/get_reward"
    rewards = openrlhf_request(secured, {"query": queries})
    assert len(rewards) == 4096
    assert rewards == pytest.approx(pipeline_scores(reward, tokenizer, raw, completions), abs=1e-5)


def test_newer_clients_sending_prompts_and_labels_score_the_same(served):
    server, reward, tokenizer, _ = served
    raw, completions, queries, prompts = samples(tokenizer, 16, seed=1)
    secured = f"http://x:{TOKEN}@127.0.0.1:{server.port}/get_reward"
    rewards = openrlhf_request(secured, {"query": queries, "prompts": prompts, "labels": [""] * 16})
    assert rewards == pytest.approx(pipeline_scores(reward, tokenizer, raw, completions), abs=1e-5)


def test_reading_the_query_as_sent_would_score_differently(served):
    """Guards the test above: the special tokens and the template do change the scores."""
    _, reward, tokenizer, _ = served
    raw, completions, queries, _ = samples(tokenizer, 16, seed=2)
    as_sent = reward.score([Item("", q) for q in queries]).scores
    assert as_sent != pytest.approx(pipeline_scores(reward, tokenizer, raw, completions), abs=1e-3)


def test_without_or_with_a_wrong_token_the_client_gives_up(served):
    server = served[0]
    base = f"127.0.0.1:{server.port}/get_reward"
    for url in (f"http://{base}", f"http://x:wrong@{base}"):
        response = requests.post(url, json={"query": ["a"]}, headers={"Content-Type": "application/json"})
        assert response.status_code == 401 and "http://user:<token>@host:port" in response.text
        with pytest.raises(RuntimeError, match="2 times"):
            openrlhf_request(url, {"query": ["a"]}, tries=2)


def test_our_remote_scorer_reads_an_openrlhf_style_server_with_the_token_in_the_url(served):
    server, reward, tokenizer, _ = served
    raw, completions, queries, prompts = samples(tokenizer, 8, seed=3)
    remote = RemoteScorer(f"http://u:{TOKEN}@127.0.0.1:{server.port}", retries=0)
    try:
        texts = [q[len(p):] for q, p in zip(queries, prompts, strict=True)]
        result = remote.score(prompts, texts)
    finally:
        remote.close()
    assert result.scores == pytest.approx(pipeline_scores(reward, tokenizer, raw, completions), abs=1e-5)
    assert {"sentiment", "model"} <= set(result.components)

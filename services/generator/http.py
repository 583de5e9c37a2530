"""The generator's HTTP app: `/healthz`, `/readyz`, `/metrics`, and the OpenAI-compatible API
(`/v1/models`, `/v1/completions`, `/v1/chat/completions`; `asyncrlhf.serving.openai`) sampling with the
weights the generator serves now (each response says which policy version)."""

from __future__ import annotations

from collections.abc import Callable

from fastapi import FastAPI

from asyncrlhf.config import Config
from asyncrlhf.metrics import make_app
from asyncrlhf.sampling import Backend
from asyncrlhf.serving.gate import BackendGate
from asyncrlhf.serving.openai import ApiContext, add_openai_api
from asyncrlhf.serving.openai.engine import ApiSampler
from asyncrlhf.serving.openai.limits import prompt_limits
from services.generator.metrics import GeneratorMetrics


def make_http_app(cfg: Config, metrics: GeneratorMetrics, backend: Backend, gate: BackendGate, tokenizer,
                  generator_id: str, ready: Callable[[], tuple[bool, str]]) -> FastAPI:
    app = make_app("generator", metrics.registry, ready)
    limits = prompt_limits(cfg, backend.context_length)
    sampler = ApiSampler(backend, gate, tokenizer, limits)
    add_openai_api(app, ApiContext(cfg.model.name_or_path, sampler, generator_id, cfg.run.token))
    return app

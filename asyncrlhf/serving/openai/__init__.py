"""An OpenAI-compatible API over a generator's backend: `GET /v1/models`, `POST /v1/completions`,
`POST /v1/chat/completions` (one small router each, as vLLM's API packages do), errors in OpenAI's shape.
The official `openai` client works against it unchanged (base_url `http://host:port/v1`, api_key the run's
token or anything when none is set)."""

from __future__ import annotations

from fastapi import FastAPI

from asyncrlhf.serving.openai.context import ApiContext
from asyncrlhf.serving.openai.errors import OpenAIError, install_error_handlers

__all__ = ["ApiContext", "OpenAIError", "add_openai_api"]


def add_openai_api(app: FastAPI, ctx: ApiContext) -> None:
    from asyncrlhf.serving.openai import chat, completions, models

    install_error_handlers(app)
    for module in (models, completions, chat):
        app.include_router(module.router(ctx))

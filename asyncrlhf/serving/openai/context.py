"""What every endpoint of the API needs: the served model's id, the sampler, identity and auth."""

from __future__ import annotations

import time
import uuid
from collections.abc import Iterable
from dataclasses import dataclass, field

from fastapi import Depends
from fastapi.responses import StreamingResponse
from pydantic import BaseModel

from asyncrlhf.service import token_dependency
from asyncrlhf.serving.openai.engine import ApiSampler
from asyncrlhf.serving.openai.errors import OpenAIError


@dataclass
class ApiContext:
    model_id: str
    sampler: ApiSampler
    generator_id: str
    token: str | None
    created: int = field(default_factory=lambda: int(time.time()))

    def auth(self) -> list:
        return [Depends(token_dependency(self.token))]

    def check_model(self, model: str) -> None:
        if model != self.model_id:
            raise OpenAIError(404, f"the model {model!r} does not exist here; this generator serves "
                                   f"{self.model_id!r} (GET /v1/models)",
                              param="model", code="model_not_found")

    def identity(self, prefix: str, version: int) -> dict:
        return {"id": f"{prefix}-{uuid.uuid4().hex}", "created": int(time.time()), "model": self.model_id,
                "policy_version": version, "generator_id": self.generator_id}


def sse(events: Iterable[BaseModel]) -> StreamingResponse:
    """Server-sent events: one `data: <json>` per event, then `data: [DONE]`."""

    def lines():
        for event in events:
            yield f"data: {event.model_dump_json()}\n\n"
        yield "data: [DONE]\n\n"

    return StreamingResponse(lines(), media_type="text/event-stream")

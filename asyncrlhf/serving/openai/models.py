"""`GET /v1/models`: the one policy this generator serves, with the weights version it serves now."""

from __future__ import annotations

from fastapi import APIRouter

from asyncrlhf.serving.openai.context import ApiContext
from asyncrlhf.serving.openai.protocol import Model, ModelList


def router(ctx: ApiContext) -> APIRouter:
    api = APIRouter()

    def model() -> Model:
        return Model(id=ctx.model_id, created=ctx.created,
                     policy_version=ctx.sampler.backend.version)

    @api.get("/v1/models", response_model=ModelList, dependencies=ctx.auth(), summary="The served policy.")
    def list_models() -> ModelList:
        return ModelList(data=[model()])

    @api.get("/v1/models/{model_id:path}", response_model=Model, dependencies=ctx.auth())
    def get_model(model_id: str) -> Model:
        ctx.check_model(model_id)
        return model()

    return api

"""The reward service's HTTP API: `/healthz`, `/readyz`, `/metrics`, and two scoring routes on the same
composite reward the consumer loop uses.

- `POST /score` (our schema): items with prompt, completion, finish reason, completion length and an optional
  reference label -> rewards, named components, inputs truncated.
- `POST /get_reward` (OpenRLHF's remote RM protocol): `{"query": [prompt + completion], "prompts"?: [...],
  "labels"?: [...], ...}` -> `{"rewards": [...], "scores": [...], "extra_logs": {component: [...]}}`, so this
  service can serve other frameworks. With the policy tokenizer loaded (the service does), a query decoded
  with special tokens and the chat template is read back into the pipeline's own item
  (`asyncrlhf.rewards.openrlhf.QueryReader`), so it scores exactly as the pipeline scores that sample.
  Without it, the completion is the query after its prompt when `prompts` is given and the query starts with
  it, else the whole query. No missing-EOS information is sent, so no missing-EOS penalty applies here.
  A batch of any size is scored `reward.max_request_items` items at a time.

Limits: POST bodies must declare a Content-Length of at most `MAX_BODY_BYTES` (411 / 413: the memory bound),
at most `reward.max_request_items` items per `/score` request, each text at most `MAX_TEXT_CHARS`. Invalid
input answers 422 with the reason. When `run.token` is set both scoring routes need it, as
`Authorization: Bearer <token>` or as HTTP basic auth with the token as password, which is what a client
that cannot set headers sends for `http://user:<token>@host:port/get_reward` (OpenRLHF's `requests` call).
"""

from __future__ import annotations

import json
import time
from collections.abc import Callable
from typing import Annotated, Any, Literal

from fastapi import Depends, HTTPException, Request
from fastapi.responses import JSONResponse
from pydantic import BaseModel, ConfigDict, Field

from asyncrlhf.metrics import make_app
from asyncrlhf.rewards import CompositeReward, Item, ScoreResult
from asyncrlhf.rewards.openrlhf import QueryReader
from asyncrlhf.service import token_dependency
from services.reward.metrics import RewardMetrics

MAX_TEXT_CHARS = 1_000_000
MAX_BODY_BYTES = 64 << 20
Text = Annotated[str, Field(max_length=MAX_TEXT_CHARS)]


class ServingState:
    """What the routes need once the service has loaded: the reward, and a Redis liveness check."""

    def __init__(self):
        self.reward: CompositeReward | None = None
        self.reader: QueryReader | None = None
        self._redis_ok: Callable[[], bool] = lambda: False

    def set_ready(self, reward: CompositeReward, redis_ok: Callable[[], bool],
                  reader: QueryReader | None = None) -> None:
        self._redis_ok, self.reader, self.reward = redis_ok, reader, reward

    def ready(self) -> tuple[bool, str]:
        if self.reward is None:
            return False, "loading scorers"
        return (True, "ok") if self._redis_ok() else (False, "Redis unreachable")


class ScoreItem(BaseModel):
    model_config = ConfigDict(extra="forbid")
    prompt: Text = Field(description="The prompt as the policy saw it (chat template applied).")
    completion: Text = Field(description="The completion text.")
    finish_reason: Literal["stop", "length"] = Field(
        "stop", description="`length`: stopped at the token limit, so the missing-EOS penalty applies."
    )
    completion_tokens: int | None = Field(None, ge=0, description="Completion length, for the length limit.")
    label: Text | None = Field(
        None, description="Reference answer, for verifiable rules such as exact_match."
    )


class ScoreRequest(BaseModel):
    model_config = ConfigDict(extra="forbid")
    items: list[ScoreItem] = Field(min_length=1, description="Completions to score.")


class ScoreResponse(BaseModel):
    rewards: list[float] = Field(description="Total reward per item: weighted sum plus penalties.")
    components: dict[str, list[float]] = Field(description="Named components, one value per item.")
    truncated: int = Field(description="Reward-model inputs cut to reward.max_length.")


class GetRewardRequest(BaseModel):
    """OpenRLHF's remote RM request; extra keys (datasources, token ids, ...) are accepted and ignored."""

    model_config = ConfigDict(extra="allow")
    query: list[Text] = Field(min_length=1, description="prompt + completion, one per item.")
    prompts: list[Text] | None = Field(None, description="The prompts, to split each query.")
    labels: list[Any] | None = Field(
        None, description="Reference answers (strings; others are JSON-encoded)."
    )


def create_app(state: ServingState, metrics: RewardMetrics, *, token: str | None, max_items: int):
    app = make_app("reward", metrics.registry, ready=state.ready)
    guard = [Depends(token_dependency(token))]

    @app.middleware("http")
    async def limit_body(request: Request, call_next):
        if request.method == "POST":
            declared = request.headers.get("content-length")
            if declared is None:
                return JSONResponse({"detail": "send a Content-Length header"}, status_code=411)
            if not declared.isdigit() or int(declared) > MAX_BODY_BYTES:
                return JSONResponse(
                    {"detail": f"body over {MAX_BODY_BYTES} bytes; split the request"}, status_code=413
                )
        return await call_next(request)

    def run(items: list[Item], chunked: bool = False) -> ScoreResult:
        if len(items) > max_items and not chunked:
            raise HTTPException(
                422, f"{len(items)} items in one request; at most {max_items} (reward.max_request_items)"
            )
        if state.reward is None:
            raise HTTPException(503, "the reward service is still loading its scorers")
        start = time.perf_counter()
        try:
            result = _concat([state.reward.score(items[i:i + max_items])
                              for i in range(0, len(items), max_items)])
        except Exception as err:
            metrics.errors.inc()
            raise HTTPException(500, f"scoring failed: {type(err).__name__}: {err}") from err
        metrics.observe(
            "http", time.perf_counter() - start, result.scores, result.components, result.truncated
        )
        return result

    @app.post("/score", dependencies=guard, response_model=ScoreResponse, summary="Score completions.")
    def score(request: ScoreRequest) -> ScoreResponse:
        items = [
            Item(it.prompt, it.completion, it.finish_reason == "stop", it.completion_tokens, it.label)
            for it in request.items
        ]
        result = run(items)
        return ScoreResponse(rewards=result.scores, components=result.components, truncated=result.truncated)

    @app.post("/get_reward", dependencies=guard, summary="OpenRLHF-compatible remote reward model.")
    def get_reward(request: GetRewardRequest) -> dict:
        result = run(openrlhf_items(request, state.reader), chunked=True)
        return {"rewards": result.scores, "scores": result.scores, "extra_logs": result.components}

    return app


def openrlhf_items(request: GetRewardRequest, reader: QueryReader | None = None) -> list[Item]:
    n = len(request.query)
    for name in ("prompts", "labels"):
        given = getattr(request, name)
        if given is not None and len(given) != n:
            raise HTTPException(
                422, f"`{name}` has {len(given)} entries but `query` has {n}; send one per query"
            )
    prompts = request.prompts or [""] * n
    labels = [_label(x) for x in request.labels] if request.labels is not None else [None] * n
    if reader is not None:
        return [reader.item(q, p, lab) for q, p, lab in zip(request.query, prompts, labels, strict=True)]
    items = []
    for query, prompt, label in zip(request.query, prompts, labels, strict=True):
        if not (prompt and query.startswith(prompt)):
            prompt = ""
        items.append(Item(prompt, query[len(prompt) :], True, None, label))
    return items


def _concat(results: list[ScoreResult]) -> ScoreResult:
    """One result for consecutive chunks (components present in every chunk)."""
    names = set.intersection(*(set(r.components) for r in results))
    return ScoreResult([s for r in results for s in r.scores],
                       {name: [v for r in results for v in r.components[name]] for name in sorted(names)},
                       sum(r.truncated for r in results))


def _label(value: Any) -> str | None:
    if value is None or isinstance(value, str):
        return value or None
    return json.dumps(value)

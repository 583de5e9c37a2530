"""`POST /v1/completions`: raw prompts (text or token ids, no chat template) sampled with the generator's
current weights; `stream`, `stop`, `seed`, `echo` and integer `logprobs` as OpenAI serves them."""

from __future__ import annotations

from collections.abc import Iterator

from fastapi import APIRouter

from asyncrlhf.serving.openai.context import ApiContext, sse
from asyncrlhf.serving.openai.engine import ApiSampler, Params, Sampled, text_pieces, usage
from asyncrlhf.serving.openai.errors import OpenAIError
from asyncrlhf.serving.openai.protocol import (
    CompletionChoice,
    CompletionLogprobs,
    CompletionRequest,
    CompletionResponse,
    Usage,
)


def prompt_ids(sampler: ApiSampler, prompt) -> tuple[list[list[int]], list[str]]:
    """(token ids, text) of each prompt: text is tokenized as the model's tokenizer does by default (BOS
    included); ids are taken as given."""
    items = [prompt] if isinstance(prompt, str) or isinstance(prompt[0], int) else prompt
    ids = [sampler.tokenizer(p)["input_ids"] if isinstance(p, str) else list(p) for p in items]
    texts = [p if isinstance(p, str) else sampler.decode(p) for p in items]
    return ids, texts


def top_dict(sampler: ApiSampler, top: list[tuple[int, float]]) -> dict[str, float]:
    """OpenAI's {token text: log-prob}; tokens that decode to the same text keep the likelier one."""
    out: dict[str, float] = {}
    for token_id, logprob in top:  # most likely first
        out.setdefault(sampler.token_text(token_id), logprob)
    return out


def logprobs_of(sampler: ApiSampler, choice: Sampled, echo: bool) -> CompletionLogprobs:
    """Per token of (prompt +) completion: its log-prob and the top alternatives (the scoring pass's,
    `engine.py` says what they mean); the first prompt token has none (nothing precedes it)."""
    ids = (choice.prompt_ids if echo else []) + choice.token_ids
    scores = choice.scores or []
    token_lps: list[float | None] = [None] + [lp for lp, _ in scores]
    tops: list[dict[str, float] | None] = [None] + [top_dict(sampler, top) for _, top in scores]
    token_lps, tops = token_lps[len(token_lps) - len(ids):], tops[len(tops) - len(ids):]
    tokens = [sampler.token_text(i) for i in ids]
    offsets = [sum(len(t) for t in tokens[:k]) for k in range(len(tokens))]
    return CompletionLogprobs(tokens=tokens, token_logprobs=token_lps, top_logprobs=tops, text_offset=offsets,
                              token_ids=ids)


def router(ctx: ApiContext) -> APIRouter:
    api = APIRouter()

    @api.post("/v1/completions", response_model=CompletionResponse, response_model_exclude_none=True,
              dependencies=ctx.auth(), summary="Sample completions with the generator's current weights.")
    def completions(request: CompletionRequest):
        ctx.check_model(request.model)
        if request.stream and (request.echo or request.logprobs is not None):
            raise OpenAIError(400, "stream=true with echo or logprobs is not served: send them without "
                                   "stream", param="stream", code="unsupported_parameter")
        sampler = ctx.sampler
        ids, texts = prompt_ids(sampler, request.prompt)
        params = Params(max_tokens=request.max_tokens, temperature=request.temperature, top_p=request.top_p,
                        seed=request.seed, stops=request.stops, top_n=request.logprobs)
        version, groups = sampler.sample(ids, request.n, params)
        counted = Usage(**usage(ids, groups))
        identity = ctx.identity("cmpl", version)
        if request.stream:
            include_usage = bool(request.stream_options and request.stream_options.include_usage)
            return sse(stream(ctx, identity, groups, counted if include_usage else None))
        choices = [
            CompletionChoice(
                index=i * request.n + j, text=(texts[i] if request.echo else "") + c.text,
                finish_reason=c.finish,
                logprobs=None if request.logprobs is None else
                logprobs_of(sampler, c, request.echo))
            for i, group in enumerate(groups) for j, c in enumerate(group)
        ]
        return CompletionResponse(**identity, choices=choices, usage=counted)

    return api


def stream(ctx: ApiContext, identity: dict, groups: list[list[Sampled]],
           counted: Usage | None) -> Iterator[CompletionResponse]:
    n = len(groups[0])
    for i, group in enumerate(groups):
        for j, choice in enumerate(group):
            for piece in text_pieces(ctx.sampler, choice):
                yield CompletionResponse(**identity, choices=[
                    CompletionChoice(index=i * n + j, text=piece, finish_reason=None)])
            yield CompletionResponse(**identity, choices=[
                CompletionChoice(index=i * n + j, text="", finish_reason=choice.finish)])
    if counted is not None:
        yield CompletionResponse(**identity, choices=[], usage=counted)

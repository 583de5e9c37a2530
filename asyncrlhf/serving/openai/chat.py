"""`POST /v1/chat/completions`: the conversation rendered by the policy tokenizer's chat template (as the
training loop's prompts are), sampled with the generator's current weights."""

from __future__ import annotations

from collections.abc import Iterator

from fastapi import APIRouter

from asyncrlhf.serving.openai.context import ApiContext, sse
from asyncrlhf.serving.openai.engine import ApiSampler, Params, Sampled, text_pieces, usage
from asyncrlhf.serving.openai.errors import OpenAIError
from asyncrlhf.serving.openai.protocol import (
    AssistantMessage,
    ChatChoice,
    ChatChunk,
    ChatChunkChoice,
    ChatLogprobs,
    ChatRequest,
    ChatResponse,
    Delta,
    TokenLogprob,
    TopLogprob,
    Usage,
)


def chat_prompt_ids(sampler: ApiSampler, request: ChatRequest) -> list[int]:
    tokenizer = sampler.tokenizer
    if not tokenizer.chat_template:
        raise OpenAIError(400, "the policy's tokenizer has no chat template: use /v1/completions",
                          param="messages", code="unsupported_parameter")
    messages = [{"role": "system" if m.role == "developer" else m.role, "content": m.text()}
                for m in request.messages]
    text = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    return tokenizer(text, add_special_tokens=False)["input_ids"]


def logprobs_of(sampler: ApiSampler, choice: Sampled) -> ChatLogprobs:
    def entry(token_id: int, logprob: float) -> TopLogprob:
        text = sampler.token_text(token_id)
        return TopLogprob(token=text, logprob=logprob, bytes=list(text.encode()))

    scores = choice.scores or []
    tops = [top for _, top in scores[len(scores) - len(choice.token_ids):]]
    return ChatLogprobs(content=[
        TokenLogprob(**entry(i, lp).model_dump(), top_logprobs=[entry(t, tlp) for t, tlp in top])
        for i, lp, top in zip(choice.token_ids, choice.logprobs, tops, strict=True)])


def router(ctx: ApiContext) -> APIRouter:
    api = APIRouter()

    @api.post("/v1/chat/completions", response_model=ChatResponse, dependencies=ctx.auth(),
              summary="Answer a conversation with the generator's current weights.")
    def chat(request: ChatRequest):
        ctx.check_model(request.model)
        if request.stream and request.logprobs:
            raise OpenAIError(400, "stream=true with logprobs is not served: send it without stream",
                              param="stream", code="unsupported_parameter")
        ids = [chat_prompt_ids(ctx.sampler, request)]
        params = Params(max_tokens=request.token_limit, temperature=request.temperature, top_p=request.top_p,
                        seed=request.seed, stops=request.stops,
                        top_n=(request.top_logprobs or 0) if request.logprobs else None)
        version, groups = ctx.sampler.sample(ids, request.n, params)
        counted = Usage(**usage(ids, groups))
        identity = ctx.identity("chatcmpl", version)
        if request.stream:
            include_usage = bool(request.stream_options and request.stream_options.include_usage)
            return sse(stream(ctx, identity, groups[0], counted if include_usage else None))
        choices = [ChatChoice(index=j, message=AssistantMessage(content=c.text), finish_reason=c.finish,
                              logprobs=logprobs_of(ctx.sampler, c) if request.logprobs else None)
                   for j, c in enumerate(groups[0])]
        return ChatResponse(**identity, choices=choices, usage=counted)

    return api


def stream(ctx: ApiContext, identity: dict, choices: list[Sampled],
           counted: Usage | None) -> Iterator[ChatChunk]:
    for j, choice in enumerate(choices):
        yield ChatChunk(**identity, choices=[
            ChatChunkChoice(index=j, delta=Delta(role="assistant", content=""))])
        for piece in text_pieces(ctx.sampler, choice):
            yield ChatChunk(**identity, choices=[ChatChunkChoice(index=j, delta=Delta(content=piece))])
        yield ChatChunk(**identity, choices=[
            ChatChunkChoice(index=j, delta=Delta(), finish_reason=choice.finish)])
    if counted is not None:
        yield ChatChunk(**identity, choices=[], usage=counted)

"""`POST /v1/chat/completions`: the conversation rendered by the policy tokenizer's chat template (as the
training loop's prompts are), sampled with the generator's current weights.

With `tools`, the tools and any tool calls and results in the conversation are rendered, and the calls the
model writes are parsed, by the code the training episodes use (`asyncrlhf.chat_format`): a choice
whose text holds well-formed calls answers `tool_calls` (finish_reason "tool_calls"); one with a malformed
call answers its text as content. `tool_choice` "required" or a named function writes the call's opening
(`<tool_call>` and the name) after the prompt: the model writes the rest, and nothing is forced after it.
"""

from __future__ import annotations

import json
from collections.abc import Iterator

from fastapi import APIRouter

from asyncrlhf.chat_format import ToolSpec, parse_tool_calls, render_chat
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
    FunctionCall,
    NamedToolChoice,
    TokenLogprob,
    ToolCallDelta,
    ToolCallItem,
    TopLogprob,
    Usage,
)


def chat_prompt_ids(sampler: ApiSampler, request: ChatRequest) -> list[int]:
    """The conversation's token ids, the opening of a forced call (`call_prefix`) included."""
    tokenizer = sampler.tokenizer
    if not tokenizer.chat_template:
        raise OpenAIError(400, "the policy's tokenizer has no chat template: use /v1/completions",
                          param="messages", code="unsupported_parameter")
    messages = [{"role": "system" if m.role == "developer" else m.role, "content": m.text(),
                 "tool_calls": [c.model_dump() for c in m.tool_calls or []], "name": m.name}
                for m in request.messages]
    tools = [ToolSpec(t.function.name, t.function.description, t.function.parameters)
             for t in request.tools or []]
    try:
        text = render_chat(tokenizer, messages, tools)
    except ValueError as err:  # a tool call's arguments that are not JSON
        raise OpenAIError(400, f"messages: {err}", param="messages", code="invalid_value") from err
    return tokenizer(text + call_prefix(request), add_special_tokens=False)["input_ids"]


def call_prefix(request: ChatRequest) -> str:
    """The opening of a tool call written for the model when `tool_choice` asks for one."""
    if request.tool_choice == "required":
        return '<tool_call>\n{"name": "'
    if isinstance(request.tool_choice, NamedToolChoice):
        return f'<tool_call>\n{{"name": "{request.tool_choice.function.name}", "arguments": '
    return ""


def answer(request: ChatRequest, choice: Sampled) -> tuple[AssistantMessage, str]:
    """The choice as an assistant message (its tool calls parsed when the request has tools) and its
    finish reason."""
    if not request.tools or request.tool_choice == "none":
        return AssistantMessage(content=choice.text), choice.finish
    written = call_prefix(request) + choice.text
    turn = parse_tool_calls(written)
    if not turn.calls or turn.errors:
        return AssistantMessage(content=written), choice.finish
    calls = [ToolCallItem(id=c.id, function=FunctionCall(name=c.name, arguments=json.dumps(c.arguments)))
             for c in turn.calls]
    return AssistantMessage(content=turn.content or None, tool_calls=calls), "tool_calls"


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
        version, groups = ctx.sampler.sample(ids, request.n, params, param="messages")
        counted = Usage(**usage(ids, groups))
        identity = ctx.identity("chatcmpl", version)
        if request.stream:
            include_usage = bool(request.stream_options and request.stream_options.include_usage)
            return sse(stream(ctx, request, identity, groups[0], counted if include_usage else None))
        answers = [answer(request, c) for c in groups[0]]
        choices = [ChatChoice(index=j, message=message, finish_reason=finish,  # type: ignore[arg-type]
                              logprobs=logprobs_of(ctx.sampler, c) if request.logprobs else None)
                   for j, (c, (message, finish)) in enumerate(zip(groups[0], answers, strict=True))]
        return ChatResponse(**identity, choices=choices, usage=counted)

    return api


def stream(ctx: ApiContext, request: ChatRequest, identity: dict, choices: list[Sampled],
           counted: Usage | None) -> Iterator[ChatChunk]:
    """What the non-streamed answer holds, in pieces: its text token by token (after a forced call's opening,
    which the server wrote), or, for a choice that called tools, its calls in one chunk."""
    for j, choice in enumerate(choices):
        message, finish = answer(request, choice)
        yield ChatChunk(**identity, choices=[
            ChatChunkChoice(index=j, delta=Delta(role="assistant", content=""))])
        if message.tool_calls:
            if message.content:
                yield ChatChunk(**identity, choices=[
                    ChatChunkChoice(index=j, delta=Delta(content=message.content))])
            calls = [ToolCallDelta(index=i, **c.model_dump()) for i, c in enumerate(message.tool_calls)]
            yield ChatChunk(**identity, choices=[ChatChunkChoice(index=j, delta=Delta(tool_calls=calls))])
        else:  # the same text as the answer's content: a forced call's opening, then what was sampled
            opening = call_prefix(request)
            for piece in ([opening] if opening else []) + text_pieces(ctx.sampler, choice):
                yield ChatChunk(**identity, choices=[ChatChunkChoice(index=j, delta=Delta(content=piece))])
        yield ChatChunk(**identity, choices=[
            ChatChunkChoice(index=j, delta=Delta(), finish_reason=finish)])  # type: ignore[arg-type]
    if counted is not None:
        yield ChatChunk(**identity, choices=[], usage=counted)

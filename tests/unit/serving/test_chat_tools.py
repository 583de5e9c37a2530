"""How a chat request with tools is rendered and answered (the HTTP round trip on both backends is in
tests/integration/serving/test_openai_tools.py): `tool_choice` required or named writes the call's opening
after the prompt, and a choice's text becomes `tool_calls` only when every call in it is well-formed."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from asyncrlhf.models import build_tiny_tokenizer
from asyncrlhf.serving.gate import BackendGate
from asyncrlhf.serving.openai.chat import answer, call_prefix, chat_prompt_ids, stream
from asyncrlhf.serving.openai.context import ApiContext
from asyncrlhf.serving.openai.engine import ApiSampler, Sampled
from asyncrlhf.serving.openai.limits import PromptLimits
from asyncrlhf.serving.openai.protocol import ChatRequest

pytestmark = pytest.mark.unit
TOOLS = [{"type": "function", "function": {"name": "add", "parameters": {"type": "object"}}}]


def request(**kw) -> ChatRequest:
    return ChatRequest(model="tiny", messages=[{"role": "user", "content": "2+3?"}], **kw)


def choice(text: str) -> Sampled:
    return Sampled([], [1], text, "stop", [0.0])


def test_a_forced_call_opening_follows_the_prompt():
    tok = build_tiny_tokenizer()
    sampler = SimpleNamespace(tokenizer=tok)
    plain = chat_prompt_ids(sampler, request(tools=TOOLS))
    named = chat_prompt_ids(sampler, request(tools=TOOLS, tool_choice={"type": "function",
                                                                       "function": {"name": "add"}}))
    prefix = '<tool_call>\n{"name": "add", "arguments": '
    assert call_prefix(request(tools=TOOLS, tool_choice="auto")) == ""
    assert named == plain + tok(prefix, add_special_tokens=False)["input_ids"]
    forced = request(tools=TOOLS, tool_choice={"type": "function", "function": {"name": "add"}})
    message, finish = answer(forced, choice('{"a": 2}}\n</tool_call>'))
    assert finish == "tool_calls" and message.tool_calls[0].function.arguments == '{"a": 2}'


def test_a_malformed_call_is_answered_as_text():
    bad = '<tool_call>{"name": "add", "arguments": {oops}</tool_call>'
    message, finish = answer(request(tools=TOOLS), choice(bad))
    assert (message.content, message.tool_calls, finish) == (bad, None, "stop")
    message, finish = answer(request(tools=TOOLS, tool_choice="required"), choice('add", "arguments": {}}'))
    assert message.content == '<tool_call>\n{"name": "add", "arguments": {}}' and finish == "stop"


@pytest.mark.parametrize("body, match", [
    ({"tool_choice": "auto"}, "tool_choice needs tools"),
    ({"tools": TOOLS, "tool_choice": {"type": "function", "function": {"name": "mul"}}}, "not in tools"),
])
def test_inconsistent_tool_requests_are_refused(body, match):
    with pytest.raises(ValueError, match=match):
        request(**body)


def test_a_tool_message_needs_the_call_it_answers():
    with pytest.raises(ValueError, match="tool_call_id"):
        ChatRequest(model="tiny", messages=[{"role": "tool", "content": "5"}])


@pytest.mark.parametrize("text", ['add", "arguments": {"a": 2}}\n</tool_call>', 'add", "arguments": {oops'])
def test_a_streamed_forced_call_says_what_the_answer_says(text):
    """With tool_choice forcing a call, the stream holds the call's opening the server wrote, as the
    non-streamed answer does: the same calls when they parse, the same content when they do not."""
    tok = build_tiny_tokenizer()
    sampler = ApiSampler(SimpleNamespace(), BackendGate(), tok, PromptLimits(None, "test"))
    ctx = ApiContext("tiny", sampler, "gen-t", None)
    forced = request(tools=TOOLS, tool_choice="required")
    sampled = Sampled([], tok(text, add_special_tokens=False)["input_ids"], text, "stop", [])
    message, finish = answer(forced, sampled)
    identity = ctx.identity("chatcmpl", 1)
    deltas = [c.choices[0] for c in stream(ctx, forced, identity, [sampled], None)]
    assert "".join(d.delta.content or "" for d in deltas) == (message.content or "")
    calls = [call for d in deltas for call in d.delta.tool_calls or []]
    assert [(c.function.name, c.function.arguments) for c in calls] == \
        [(c.function.name, c.function.arguments) for c in message.tool_calls or []]
    assert deltas[-1].finish_reason == finish

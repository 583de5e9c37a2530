"""The tool-call convention: parsing a model turn, and rendering tools and results into the chat template
(the tiny tokenizer's template does not render tools: the convention is written into the conversation)."""

from __future__ import annotations

import pytest

from asyncrlhf.chat_format import ToolCall, ToolSpec, observation_text, parse_tool_calls, render_chat
from asyncrlhf.models import build_tiny_tokenizer

pytestmark = pytest.mark.unit


def test_calls_are_parsed_with_the_text_around_them():
    turn = parse_tool_calls('Let me add.\n<tool_call>\n{"name": "add", "arguments": {"a": 1}}\n</tool_call>'
                            '<tool_call>{"name": "neg", "arguments": "{\\"x\\": 2}"}</tool_call>')
    assert turn.content == "Let me add."
    assert [(c.name, c.arguments) for c in turn.calls] == [("add", {"a": 1}), ("neg", {"x": 2})]
    assert turn.errors == []


@pytest.mark.parametrize("text, reason", [
    ("<tool_call>{bad}</tool_call>", "not JSON"),
    ('<tool_call>{"arguments": {}}</tool_call>', "no string `name`"),
    ('<tool_call>{"name": "f", "arguments": [1]}</tool_call>', "not a JSON object"),
    ('<tool_call>{"name": "f", "arguments": {}}', "never closed"),
])
def test_each_malformed_call_is_named(text, reason):
    turn = parse_tool_calls(text)
    assert turn.calls == [] and len(turn.errors) == 1 and reason in turn.errors[0]


def test_a_turn_without_calls_is_plain_content():
    assert parse_tool_calls(" 42 ") == parse_tool_calls("42")
    assert parse_tool_calls("42").calls == [] and parse_tool_calls("42").content == "42"


def test_a_template_without_tools_gets_them_written_into_the_conversation():
    tok = build_tiny_tokenizer()
    text = render_chat(tok, [{"role": "user", "content": "2+3?"},
                             {"role": "assistant", "content": "", "tool_calls": [ToolCall("add", {"a": 2})]},
                             {"role": "tool", "content": "5"}], [ToolSpec("add", "adds")])
    assert text.startswith("<s>system\nTools you can call:\n<tools>\n")
    assert '"name": "add", "description": "adds"' in text
    assert '<s>assistant\n<tool_call>\n{"name": "add", "arguments": {"a": 2}}\n</tool_call></s>' in text
    assert text.endswith("<s>user\n<tool_response>\n5\n</tool_response></s>\n<s>assistant\n")


def test_an_observation_is_what_follows_the_sampled_eos():
    """The model's turn ends with the EOS it sampled; the observation starts right after it and ends with
    the next assistant turn's opening, so sampled ids + observation ids render the conversation."""
    tok = build_tiny_tokenizer()
    observed = observation_text(tok, [{"role": "tool", "content": "5"}])
    assert observed == "\n<s>user\n<tool_response>\n5\n</tool_response></s>\n<s>assistant\n"
    messages = [{"role": "user", "content": "q"}, {"role": "assistant", "content": "a"}]
    before = render_chat(tok, messages, add_generation_prompt=False)
    assert before[: before.rindex("</s>") + 4] + observed == render_chat(
        tok, [*messages, {"role": "tool", "content": "5"}])

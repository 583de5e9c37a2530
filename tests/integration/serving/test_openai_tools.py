"""Tool calling through `/v1/chat/completions` with the official `openai` client and the OpenAI Agents SDK,
on HF and vLLM: tools in, `tool_calls` out, the tool's result sent back in, the model's answer out.

How the calls are produced: the tiny model is first taught (`tests.taught`, under a minute of Adam) to
answer this conversation with a Hermes-style `<tool_call>` and the conversation with the tool's result with
an answer; the taught weights are pushed to the backend like a learner's, and the server samples greedily.
So the server's rendering of tools and tool results, its sampling and its parsing are the real ones: a
rendering that differed from the one taught would not reproduce the call. The tokenizer gets a short chat
template that renders `tools` itself (the path Qwen-style templates take), so the taught sequences stay short
for the byte-level tiny tokenizer."""

from __future__ import annotations

import asyncio
import json

import openai
import pytest
from agents import Agent, ModelSettings, OpenAIChatCompletionsModel, RunConfig, Runner, function_tool

from asyncrlhf.chat_format import ToolCall, ToolSpec, render_chat
from asyncrlhf.models import load_policy
from asyncrlhf.serving.openai.chat import call_prefix
from asyncrlhf.serving.openai.protocol import ChatRequest
from asyncrlhf.version import PolicyVersion
from tests.integration.serving.test_openai_client import MODEL, TOKEN, Served
from tests.taught import teach

pytestmark = pytest.mark.integration

ADD = ToolSpec("add", "a+b", {"type": "object", "properties": {"a": {"type": "integer"},
                                                               "b": {"type": "integer"}}})
QUESTION = [{"role": "user", "content": "What is 2+3?"}]
CALL = ToolCall("add", {"a": 2, "b": 3}, id="call_0")
CALL_TEXT = '<tool_call>{"name":"add","arguments":{"a":2,"b":3}}</tool_call>'  # what the model is taught
ANSWER = "It is 5."
NAMED = {"type": "function", "function": {"name": "add"}}
FORCED_REST = '{"a": 2, "b": 3}}\n</tool_call>'  # what the model writes after a forced call's opening
TEMPLATE = ("{% if tools %}<s>system\n{% for t in tools %}{{ t.function.name }}{% endfor %}</s>\n{% endif %}"
            "{% for m in messages %}<s>{{ m.role }}\n{% if m.tool_calls %}{% for c in m.tool_calls %}"
            "<tool_call>{{ c.function | tojson }}</tool_call>{% endfor %}{% else %}{{ m.content }}{% endif %}"
            "</s>\n{% endfor %}{% if add_generation_prompt %}<s>assistant\n{% endif %}")


def taught_weights(served: Served):
    """The tiny model taught the two turns of the conversation, as the server will render them."""
    tok = served.tokenizer

    def ids(text: str) -> list[int]:
        return tok(text, add_special_tokens=False)["input_ids"]

    after_call = QUESTION + [{"role": "assistant", "content": "", "tool_calls": [CALL]},
                             {"role": "tool", "content": "5", "tool_call_id": "call_0"}]
    forced = call_prefix(ChatRequest(model=MODEL, messages=QUESTION, tools=[ADD.openai()], tool_choice=NAMED))
    pairs = [(ids(render_chat(tok, QUESTION, [ADD])), ids(CALL_TEXT) + [tok.eos_token_id]),
             (ids(render_chat(tok, QUESTION, [ADD]) + forced), ids(FORCED_REST) + [tok.eos_token_id]),
             (ids(render_chat(tok, after_call, [ADD])), ids(ANSWER) + [tok.eos_token_id])]
    return teach(load_policy(served.cfg.model), pairs).state_dict()


@pytest.fixture(scope="module", params=["hf", pytest.param("vllm", marks=pytest.mark.vllm)])
def served(request, tmp_path_factory):
    s = Served(request.param, tmp_path_factory.mktemp("models"), version=0)
    s.tokenizer.chat_template = TEMPLATE  # the tokenizer the server renders with
    s.backend.apply_weights(taught_weights(s), version=PolicyVersion(0, 1))
    yield s
    s.close()


def test_a_tool_call_round_trip(served):
    tools = [ADD.openai()]
    first = served.client.chat.completions.create(model=MODEL, messages=QUESTION, tools=tools,
                                                  temperature=0, max_tokens=64)
    choice = first.choices[0]
    assert choice.finish_reason == "tool_calls"
    (call,) = choice.message.tool_calls
    assert call.type == "function" and call.function.name == "add"
    assert json.loads(call.function.arguments) == {"a": 2, "b": 3}
    assert call.id.startswith("call_")
    result = {"role": "tool", "tool_call_id": call.id, "content": "5"}
    second = served.client.chat.completions.create(
        model=MODEL, messages=[*QUESTION, choice.message.model_dump(exclude_none=True), result], tools=tools,
        temperature=0, max_tokens=64)
    assert second.choices[0].finish_reason == "stop"
    assert second.choices[0].message.content == ANSWER and not second.choices[0].message.tool_calls


def test_tool_choice_none_returns_the_call_as_text(served):
    reply = served.client.chat.completions.create(model=MODEL, messages=QUESTION, tools=[ADD.openai()],
                                                  tool_choice="none", temperature=0, max_tokens=64)
    assert reply.choices[0].message.tool_calls is None and reply.choices[0].finish_reason == "stop"
    assert reply.choices[0].message.content == CALL_TEXT


def test_a_streamed_tool_call_arrives_in_one_chunk(served):
    chunks = list(served.client.chat.completions.create(
        model=MODEL, messages=QUESTION, tools=[ADD.openai()], temperature=0, max_tokens=64, stream=True))
    calls = [c.choices[0].delta.tool_calls for c in chunks if c.choices and c.choices[0].delta.tool_calls]
    assert len(calls) == 1 and calls[0][0].function.name == "add" and calls[0][0].index == 0
    assert chunks[-1].choices[0].finish_reason == "tool_calls"


def test_tool_choice_naming_a_missing_tool_is_refused(served):
    with pytest.raises(openai.BadRequestError, match="not in tools"):
        served.client.chat.completions.create(
            model=MODEL, messages=QUESTION, tools=[ADD.openai()], max_tokens=4,
            tool_choice={"type": "function", "function": {"name": "mul"}})


def test_a_forced_call_streamed_and_not_says_the_same(served):
    kw = dict(model=MODEL, messages=QUESTION, tools=[ADD.openai()], tool_choice=NAMED, temperature=0,
              max_tokens=64)
    whole = served.client.chat.completions.create(**kw).choices[0]
    chunks = list(served.client.chat.completions.create(**kw, stream=True))
    (call,) = whole.message.tool_calls
    streamed = [c for chunk in chunks for c in chunk.choices[0].delta.tool_calls or []]
    assert [(c.function.name, c.function.arguments) for c in streamed] == [("add", call.function.arguments)]
    assert json.loads(call.function.arguments) == {"a": 2, "b": 3}
    assert "".join(c.choices[0].delta.content or "" for c in chunks) == (whole.message.content or "")


def test_an_agent_forces_a_call_runs_the_tool_and_answers(served):
    """The OpenAI Agents SDK (its Chat Completions model, over the real `openai` client) runs an agent whose
    `tool_choice` forces its one function tool: the server writes the call's opening, the model the rest;
    the call is parsed, the SDK runs the tool and sends its result back (with tool_choice reset, as the
    SDK does after a tool ran), and the model's answer is the run's final output."""
    calls = []

    @function_tool
    def add(a: int, b: int) -> int:
        """a+b"""
        calls.append((a, b))
        return a + b

    client = openai.AsyncOpenAI(base_url=f"{served.http.url}/v1", api_key=TOKEN, max_retries=0)
    agent = Agent(name="calculator", tools=[add],
                  model=OpenAIChatCompletionsModel(model=MODEL, openai_client=client),
                  model_settings=ModelSettings(tool_choice="add", temperature=0, max_tokens=64))
    offline = RunConfig(tracing_disabled=True)  # no traces sent to OpenAI
    result = asyncio.run(Runner.run(agent, QUESTION[0]["content"], run_config=offline))
    assert calls == [(2, 3)]
    assert [item.type for item in result.new_items] == \
        ["tool_call_item", "tool_call_output_item", "message_output_item"]
    assert result.final_output == ANSWER

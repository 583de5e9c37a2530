"""The chat format: tool calls in a model's text, and tools and tool results in its chat template. One
convention, shared by the episodes (`asyncrlhf.envs.episode`), the tasks that score tool calls
(`asyncrlhf.tasks.arithmetic`) and the OpenAI API (`/v1/chat/completions` with `tools`); it imports nothing
of the project, so each of them reaches down to it.

The convention is the Hermes one that Qwen2.5/3, Hermes, and most Hugging Face chat templates with tool
support use: the model writes each call as a JSON object `{"name": ..., "arguments": {...}}` inside
`<tool_call>...</tool_call>`, and a tool's result comes back inside `<tool_response>...</tool_response>`.

A chat template that renders `tools` itself (its source mentions `tools`) is given the tools and the
messages as they are (OpenAI-shaped `tool_calls` on assistant messages, `tool` messages for results). One
that does not (SmolLM2-135M-Instruct's, the tiny test model's) gets the same convention written into the
conversation: the tool signatures in the system message, the calls in the assistant's text, and each result
as a user message wrapping it in `<tool_response>`.
"""

from __future__ import annotations

import json
import re
import uuid
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

CALL_OPEN, CALL_CLOSE = "<tool_call>", "</tool_call>"
_CALL = re.compile(r"<tool_call>(.*?)</tool_call>", re.S)

Message = dict[str, Any]


@dataclass(frozen=True)
class ToolSpec:
    """A tool the model may call: its name, what it does, and its arguments as a JSON schema."""

    name: str
    description: str = ""
    parameters: Mapping[str, Any] = field(default_factory=lambda: {"type": "object", "properties": {}})

    def openai(self) -> dict[str, Any]:
        """OpenAI's (and Hugging Face chat templates') shape: {"type": "function", "function": {...}}."""
        return {"type": "function", "function": {"name": self.name, "description": self.description,
                                                 "parameters": dict(self.parameters)}}


@dataclass(frozen=True)
class ToolCall:
    name: str
    arguments: dict[str, Any]
    id: str = field(default_factory=lambda: f"call_{uuid.uuid4().hex[:24]}")

    def openai(self) -> dict[str, Any]:
        """An assistant message's `tool_calls` entry (arguments as a JSON string, as OpenAI sends them)."""
        return {"id": self.id, "type": "function",
                "function": {"name": self.name, "arguments": json.dumps(self.arguments)}}

    def text(self) -> str:
        """The call as the model writes it."""
        return f"{CALL_OPEN}\n{json.dumps({'name': self.name, 'arguments': self.arguments})}\n{CALL_CLOSE}"


@dataclass(frozen=True)
class ParsedTurn:
    """A model turn: its text outside the tool-call blocks, the well-formed calls, and one reason per
    malformed block (bad JSON, no name, arguments not an object, a block never closed)."""

    content: str
    calls: list[ToolCall]
    errors: list[str]


def parse_tool_calls(text: str) -> ParsedTurn:
    """The tool calls in a model turn's text (special tokens already skipped)."""
    calls: list[ToolCall] = []
    errors: list[str] = []
    for match in _CALL.finditer(text):
        call = _call(match.group(1).strip())
        if isinstance(call, str):
            errors.append(call)
        else:
            calls.append(call)
    rest = _CALL.sub("", text)
    if CALL_OPEN in rest:
        errors.append(f"a {CALL_OPEN} block is never closed with {CALL_CLOSE}")
        rest = rest[: rest.index(CALL_OPEN)]
    return ParsedTurn(rest.strip(), calls, errors)


def _call(body: str) -> ToolCall | str:
    try:
        obj = json.loads(body)
    except json.JSONDecodeError as err:
        return f"the tool call is not JSON ({err.msg} at character {err.pos}): {body[:80]!r}"
    if not isinstance(obj, dict) or not isinstance(obj.get("name"), str) or not obj["name"]:
        return f"the tool call has no string `name`: {body[:80]!r}"
    arguments = obj.get("arguments", obj.get("parameters", {}))
    if isinstance(arguments, str):  # some models write the arguments as a JSON string, as OpenAI sends them
        try:
            arguments = json.loads(arguments)
        except json.JSONDecodeError:
            return f"the arguments of `{obj['name']}` are a string that is not JSON: {arguments[:80]!r}"
    if not isinstance(arguments, dict):
        return f"the arguments of `{obj['name']}` are not a JSON object: {body[:80]!r}"
    return ToolCall(obj["name"], arguments)


# -- the chat template ------------------------------------------------------------------------------------


def template_knows_tools(tokenizer) -> bool:
    """Whether the tokenizer's chat template renders `tools` and `tool` messages itself."""
    template = tokenizer.chat_template or ""
    return "tools" in template and "tool_call" in template


def tools_system_text(tools: Sequence[ToolSpec]) -> str:
    """The tool signatures and the call format, for a template that does not render tools itself."""
    signatures = "\n".join(json.dumps(t.openai()) for t in tools)
    return (f"Tools you can call:\n<tools>\n{signatures}\n</tools>\n"
            f'Call one as {CALL_OPEN}{{"name": ..., "arguments": {{...}}}}{CALL_CLOSE}; '
            "its result comes back in <tool_response></tool_response>.")


def render_chat(tokenizer, messages: Sequence[Message], tools: Sequence[ToolSpec] = (), *,
                add_generation_prompt: bool = True) -> str:
    """The conversation as the chat template renders it, tools and tool results included.

    messages: OpenAI-shaped dicts: `role` (system, user, assistant, tool), `content`, and for an assistant
    turn that called tools `tool_calls` (a list of `ToolCall`, or OpenAI dicts with JSON-string arguments).
    """
    if template_knows_tools(tokenizer):
        native = [_native(m) for m in messages]
        return tokenizer.apply_chat_template(native, tools=[t.openai() for t in tools] or None,
                                             add_generation_prompt=add_generation_prompt, tokenize=False)
    written = [_written(m) for m in messages]
    if tools:
        text = tools_system_text(tools)
        if written and written[0]["role"] == "system":
            written[0] = {"role": "system", "content": f"{written[0]['content']}\n\n{text}"}
        else:
            written.insert(0, {"role": "system", "content": text})
    return tokenizer.apply_chat_template(written, add_generation_prompt=add_generation_prompt, tokenize=False)


def _calls_of(message: Mapping[str, Any]) -> list[ToolCall]:
    out = []
    for c in message.get("tool_calls") or []:
        if isinstance(c, ToolCall):
            out.append(c)
        else:
            fn = c["function"]
            args = fn["arguments"]
            out.append(ToolCall(fn["name"], json.loads(args) if isinstance(args, str) else dict(args),
                                c.get("id") or ""))
    return out


def _native(message: Mapping[str, Any]) -> Message:
    out: Message = {"role": message["role"], "content": message.get("content") or ""}
    calls = _calls_of(message)
    if calls:  # Hugging Face templates take the arguments as a mapping
        out["tool_calls"] = [{"type": "function", "function": {"name": c.name, "arguments": c.arguments}}
                             for c in calls]
    if message["role"] == "tool" and message.get("name"):
        out["name"] = message["name"]
    return out


def _written(message: Mapping[str, Any]) -> Message:
    role, content = message["role"], message.get("content") or ""
    if role == "tool":
        return {"role": "user", "content": f"<tool_response>\n{content}\n</tool_response>"}
    calls = _calls_of(message)
    if calls:
        content = "\n".join([content] * bool(content) + [c.text() for c in calls])
    return {"role": role, "content": content}


def observation_text(tokenizer, results: Sequence[Message], tools: Sequence[ToolSpec] = ()) -> str:
    """What follows a model turn that ended with EOS, up to the next assistant turn's opening: the results'
    messages (`tool` messages, or a `user` message) as the template renders them after an assistant turn.

    Found as the difference between two renderings of a probe conversation, cut after the assistant turn's
    end-of-turn token (the EOS the model sampled, which is already in its tokens)."""
    probe_answer = "\x00probe\x00"
    base = [{"role": "user", "content": "probe"}, {"role": "assistant", "content": probe_answer}]
    before = render_chat(tokenizer, base, tools, add_generation_prompt=False)
    after = render_chat(tokenizer, base + list(results), tools, add_generation_prompt=True)
    if not after.startswith(before[: before.rindex(probe_answer)]):
        raise ValueError("the chat template renders an earlier turn differently once results follow it; "
                         "observations cannot be appended to the sampled tokens")
    end = before.rindex(probe_answer) + len(probe_answer)
    eos = tokenizer.eos_token or ""
    if eos and before.find(eos, end) >= 0:
        end = before.find(eos, end) + len(eos)
    return after[end:]

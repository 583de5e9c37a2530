"""Tools for episodes: Python functions, or the tools of an MCP server (`asyncrlhf.envs.mcp_server`), and the
environment that runs them (`ToolEnv`): each model turn's tool calls are run and their results come back as
`tool` messages; a turn without a call is the answer, scored by a verifier against the task's reference.

A tool that raises (or an MCP tool that answers an error) is a failed call: its error goes back to the model
as the tool's result, and it is counted by tool (`tool_errors`); a malformed call is counted under
`<malformed>`. Neither ends the episode: that is for the environment itself failing (`asyncrlhf.envs.base`),
as an MCP server that stopped answering does (`McpServerDown`; it is started again for the next episodes).
"""

from __future__ import annotations

import inspect
import json
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from asyncrlhf.chat_format import Message, ToolSpec, parse_tool_calls
from asyncrlhf.envs.base import EnvFailure, Observation

MALFORMED = "<malformed>"
_JSON_TYPES = {int: "integer", float: "number", str: "string", bool: "boolean", list: "array", dict: "object"}


@dataclass(frozen=True)
class Tool:
    spec: ToolSpec
    call: Callable[[dict[str, Any]], str]


def python_tool(fn: Callable[..., Any]) -> Tool:
    """A Python function as a tool: its name, its docstring's first line, its parameters (annotated int,
    float, str, bool, list or dict) as the JSON schema; it is called with the arguments as keywords and its
    result is sent back as text (JSON for anything but a string)."""
    signature = inspect.signature(fn)
    hints = inspect.get_annotations(fn, eval_str=True)
    properties = {name: {"type": _JSON_TYPES.get(hints.get(name, str), "string")}
                  for name in signature.parameters}
    required = [n for n, p in signature.parameters.items() if p.default is p.empty]
    doc = (inspect.getdoc(fn) or "").split("\n")[0]
    spec = ToolSpec(fn.__name__, doc, {"type": "object", "properties": properties, "required": required})

    def call(arguments: dict[str, Any]) -> str:
        signature.bind(**arguments)  # TypeError naming the argument, sent back to the model
        out = fn(**arguments)
        return out if isinstance(out, str) else json.dumps(out)

    return Tool(spec, call)


Verifier = Callable[[str, str | None], float]


class ToolEnv:
    """A prompt answered with the help of tools; the reward is `verify(answer, reference)` on the turn that
    calls none (0 without a verifier)."""

    def __init__(self, tools: Sequence[Tool], verify: Verifier | None = None):
        self._tools = {t.spec.name: t for t in tools}
        self.tools = [t.spec for t in tools]
        self.verify = verify
        self.reference: str | None = None
        self._calls: dict[str, int] = {}
        self._errors: dict[str, int] = {}

    def reset(self, prompt: str, reference: str | None = None) -> Observation:
        self.reference = reference
        return prompt

    def step(self, action: str) -> tuple[Observation, float, bool]:
        turn = parse_tool_calls(action)
        self._calls, self._errors = {}, {}
        if not turn.calls and not turn.errors:
            return [], (self.verify(turn.content, self.reference) if self.verify else 0.0), True
        results: list[Message] = []
        for error in turn.errors:
            self._count(MALFORMED, failed=True)
            results.append({"role": "tool", "name": MALFORMED, "content": f"error: {error}"})
        for call in turn.calls:
            content = self._run(call.name, call.arguments)
            results.append({"role": "tool", "name": call.name, "content": content})
        return results, 0.0, False

    def _run(self, name: str, arguments: dict[str, Any]) -> str:
        tool = self._tools.get(name)
        if tool is None:
            self._count(name, failed=True)
            return f"error: there is no tool `{name}`; the tools are {', '.join(self._tools)}"
        try:
            out = tool.call(arguments)
        except EnvFailure:  # the environment itself failed (an MCP server down): the episode ends
            raise
        except Exception as err:  # a failed call is the model's to see, not the episode's end
            self._count(name, failed=True)
            return f"error: {type(err).__name__}: {err}"
        self._count(name, failed=False)
        return out

    def _count(self, name: str, *, failed: bool) -> None:
        self._calls[name] = self._calls.get(name, 0) + 1
        if failed:
            self._errors[name] = self._errors.get(name, 0) + 1

    def last_step_report(self) -> tuple[Mapping[str, int], Mapping[str, int]]:
        """Calls and failed calls by tool in the last step (what the generator's metrics count)."""
        return self._calls, self._errors

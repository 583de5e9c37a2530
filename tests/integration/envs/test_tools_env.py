"""Tools for episodes: Python functions and the tools of a real MCP server (a subprocess over stdio, the
`mcp` SDK), run by `ToolEnv` from what the model writes; and `task.env` loaded as the generator loads it."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

from asyncrlhf.config import EnvConfig
from asyncrlhf.envs import base
from asyncrlhf.envs.loading import EnvConfigError, EnvFactory, calculator
from asyncrlhf.envs.toolcalls import ToolCall

pytestmark = pytest.mark.integration
SERVER = [sys.executable, str(Path(__file__).with_name("lookup_server.py"))]


@pytest.fixture(scope="module")
def mcp_tools():
    factory = EnvFactory(EnvConfig(kind="tools", tools=["calculator"], mcp=SERVER, verifier="math_answer"))
    yield factory
    factory.close()


def test_the_tools_are_listed_with_their_schemas(mcp_tools):
    env = mcp_tools()
    specs = {t.name: t for t in env.tools}
    assert set(specs) == {"calculator", "capital", "broken"}
    assert specs["calculator"].parameters["properties"] == {"expression": {"type": "string"}}
    assert specs["capital"].parameters["properties"]["country"]["type"] == "string"
    assert specs["capital"].description == "The capital city of a country."


def test_calls_run_and_failures_go_back_to_the_model(mcp_tools):
    env = mcp_tools()
    assert base.reset(env, "What is 6*7?", "42", 5.0) == [{"role": "user", "content": "What is 6*7?"}]
    action = "\n".join(c.text() for c in [ToolCall("calculator", {"expression": "6*7"}),
                                          ToolCall("capital", {"country": "Japan"}),
                                          ToolCall("broken", {"x": 1}), ToolCall("nope", {})])
    result = base.step(env, action + "<tool_call>{oops</tool_call>", 5.0)
    contents = [m["content"] for m in result.messages]
    assert contents[0].startswith("error: the tool call is not JSON")
    assert contents[1:3] == ["42", "Tokyo"]
    assert contents[3] == "error: RuntimeError: Error executing tool broken"  # the server's own message
    assert contents[4].startswith("error: there is no tool `nope`")
    assert not result.done and result.reward == 0.0
    assert result.tool_calls == {"<malformed>": 1, "calculator": 1, "capital": 1, "broken": 1, "nope": 1}
    assert result.tool_errors == {"<malformed>": 1, "broken": 1, "nope": 1}
    final = base.step(env, "The answer is 42.", 5.0)
    assert final.done and final.reward == 1.0 and final.messages == []


def test_the_calculator_refuses_what_is_not_arithmetic():
    assert calculator("2 + 3 * (4 - 1)") == "11" and calculator("7/2") == "3.5"
    with pytest.raises(ValueError, match="not arithmetic"):
        calculator("__import__('os').system('true')")


def test_a_class_env_from_a_file(tmp_path):
    path = tmp_path / "my_env.py"
    path.write_text("class Echo:\n    def __init__(self, times=1):\n        self.times = times\n"
                    "    def reset(self, prompt):\n        return prompt * self.times\n"
                    "    def step(self, action):\n        return '', 1.0, True\n")
    env = EnvFactory(EnvConfig(kind="class", path=f"{path}:Echo", args={"times": 2}))()
    assert base.reset(env, "ab", None, 5.0) == [{"role": "user", "content": "abab"}]
    with pytest.raises(EnvConfigError, match="has no function `Nope`"):
        EnvFactory(EnvConfig(kind="class", path=f"{path}:Nope"))
    with pytest.raises(EnvConfigError, match="unknown tool `calc`"):
        EnvFactory(EnvConfig(kind="tools", tools=["calc"]))

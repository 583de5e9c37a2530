"""Tools for episodes: Python functions and the tools of a real MCP server (a subprocess over stdio, the
`mcp` SDK), run by `ToolEnv` from what the model writes; a server killed mid-run; and `task.env` loaded as
the generator loads it."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import psutil
import pytest

from asyncrlhf.chat_format import ToolCall
from asyncrlhf.config import EnvConfig, load_config
from asyncrlhf.envs import base
from asyncrlhf.envs.loading import EnvConfigError, EnvFactory, calculator
from asyncrlhf.envs.mcp_server import McpServer

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


def servers(besides: frozenset[int] = frozenset()) -> list[psutil.Process]:
    """This process's live lookup-server processes, but those in `besides`."""
    return [p for p in psutil.Process().children(recursive=True)
            if p.pid not in besides and p.status() != psutil.STATUS_ZOMBIE and SERVER[1] in p.cmdline()]


def test_a_killed_mcp_server_ends_the_episode_that_finds_it_and_is_started_again():
    """The server's process is SIGKILLed mid-run: the call that finds it dead ends its episode with a reason
    that says so (no tool message with the error for the model to go on from), the server is started again,
    and the next episodes' calls are answered by the new process; closing the factory ends it."""
    others = frozenset(p.pid for p in servers())  # the module's server
    factory = EnvFactory(EnvConfig(kind="tools", mcp=SERVER, step_timeout_s=60.0))
    try:
        env = factory()
        base.reset(env, "Where?", None, 60.0)
        paris = base.step(env, ToolCall("capital", {"country": "France"}).text(), 60.0)
        assert paris.messages[0]["content"] == "Paris"
        (first,) = servers(others)
        first.kill()
        first.wait(30)
        with pytest.raises(base.EnvFailure, match="stopped answering .*; started again; this episode ends"):
            base.step(env, ToolCall("capital", {"country": "Japan"}).text(), 60.0)
        after = factory()
        base.reset(after, "Where?", None, 60.0)
        result = base.step(after, ToolCall("capital", {"country": "Japan"}).text(), 60.0)
        assert [m["content"] for m in result.messages] == ["Tokyo"] and result.tool_errors == {}
        (second,) = servers(others)
        assert second.pid != first.pid and factory.mcp is not None and factory.mcp.restarts == 1
    finally:
        factory.close()
    second.wait(30)  # closing ended the server's process


def test_an_mcp_server_that_does_not_start_again_stays_down_until_a_later_try_succeeds(monkeypatch):
    """Killed, and its command now fails to start: the episode that found it ends saying the restart failed;
    calls before the next try end their episodes at once (`is down`); a later try that starts it serves."""
    monkeypatch.setattr(McpServer, "RESTART_EVERY_S", 3600.0)
    others = frozenset(p.pid for p in servers())
    factory = EnvFactory(EnvConfig(kind="tools", mcp=SERVER, step_timeout_s=60.0))
    try:
        server = factory.mcp
        assert server is not None
        env = factory()
        base.reset(env, "Where?", None, 60.0)
        (first,) = servers(others)
        server.command = [sys.executable, "-c", "raise SystemExit(3)"]  # what a broken install would do
        first.kill()
        first.wait(30)
        call = ToolCall("capital", {"country": "Japan"}).text()
        with pytest.raises(base.EnvFailure, match="not started again: it did not start"):
            base.step(env, call, 60.0)
        with pytest.raises(base.EnvFailure, match="is down .*did not start"):
            base.step(factory(), call, 60.0)  # no new try within RESTART_EVERY_S
        server.command, server.RESTART_EVERY_S = SERVER, 0.0  # fixed; the next call tries again
        assert [m["content"] for m in base.step(factory(), call, 60.0).messages] == ["Tokyo"]
    finally:
        factory.close()


def test_a_generator_that_stops_closes_its_environments(redis_url, run_name):
    """The generator service's close (what its process runs at SIGTERM) ends its MCP server's process."""
    from services.generator.run import GeneratorService

    others = frozenset(p.pid for p in servers())
    cfg = load_config(["configs/tiny.yaml"], ["generator.device=cpu", f"redis.url={redis_url}",
                                              f"run.name={run_name}", "task.env.kind=tools",
                                              f"task.env.mcp={json.dumps(SERVER)}"])
    service = GeneratorService(cfg, generator_id="gen-envs")
    (server,) = servers(others)
    service.close()
    server.wait(30)  # ended: the wait returns

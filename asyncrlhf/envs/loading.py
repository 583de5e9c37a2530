"""`task.env` -> a factory of environments, one per episode: your class from a file, a `ToolEnv` over
Python functions and an MCP server's tools, a `verifiers` environment, or sessions of an OpenEnv server,
loaded once per generator (files are imported as reward functions are:
`asyncrlhf.rewards.rules.load_rule_file`)."""

from __future__ import annotations

import ast
import operator
from collections.abc import Callable
from typing import Any

from asyncrlhf.config import EnvConfig
from asyncrlhf.envs.base import Env
from asyncrlhf.envs.mcp_server import McpServer
from asyncrlhf.envs.openenv import OpenEnvEpisode, OpenEnvError, OpenEnvSpec
from asyncrlhf.envs.tools import Tool, ToolEnv, Verifier, python_tool
from asyncrlhf.envs.verifiers_env import VerifiersEpisode, VerifiersLoadError, load_verifiers_env, tool_specs
from asyncrlhf.rewards.base import ScorerConfigError
from asyncrlhf.rewards.math import math_score
from asyncrlhf.rewards.rules import load_rule_file


class EnvConfigError(ValueError):
    """`task.env` names something that cannot be loaded; the message says what to fix."""


_OPS: dict[type, Callable[..., Any]] = {
    ast.Add: operator.add, ast.Sub: operator.sub, ast.Mult: operator.mul, ast.Div: operator.truediv,
    ast.USub: operator.neg, ast.UAdd: operator.pos, ast.Pow: operator.pow, ast.Mod: operator.mod,
    ast.FloorDiv: operator.floordiv}


def calculator(expression: str) -> str:
    """Evaluate an arithmetic expression (+ - * / // % ** and parentheses) and return the result."""

    def value(node: ast.AST) -> float:
        if isinstance(node, ast.Constant) and type(node.value) in (int, float):
            return float(node.value)  # type: ignore[arg-type]
        if isinstance(node, ast.BinOp) and type(node.op) in _OPS:
            if isinstance(node.op, ast.Pow) and abs(value(node.right)) > 64:
                raise ValueError("exponent too large")
            return _OPS[type(node.op)](value(node.left), value(node.right))
        if isinstance(node, ast.UnaryOp) and type(node.op) in _OPS:
            return _OPS[type(node.op)](value(node.operand))
        raise ValueError(f"not arithmetic: {ast.dump(node)[:40]}")

    out = value(ast.parse(expression.strip(), mode="eval").body)
    return str(int(out)) if float(out).is_integer() else f"{out:.6g}"


SHIPPED_TOOLS: dict[str, Callable[..., Any]] = {"calculator": calculator}
SHIPPED_VERIFIERS: dict[str, Verifier] = {"math_answer": lambda answer, ref: math_score(answer, ref or "")}


def _from_file(spec: str, what: str) -> Any:
    path, _, name = spec.rpartition(":")
    if not path or not name:
        raise EnvConfigError(f"{what} `{spec}`: give `file.py:name`")
    try:
        return load_rule_file(path, name)
    except ScorerConfigError as err:
        raise EnvConfigError(f"{what}: {err}") from None


def load_tool(spec: str) -> Tool:
    if spec in SHIPPED_TOOLS:
        return python_tool(SHIPPED_TOOLS[spec])
    if ":" not in spec:
        raise EnvConfigError(f"unknown tool `{spec}`; shipped: {', '.join(SHIPPED_TOOLS)}, or "
                             "`file.py:function`")
    return python_tool(_from_file(spec, "task.env.tools"))


def load_verifier(spec: str | None) -> Verifier | None:
    if spec is None or spec in SHIPPED_VERIFIERS:
        return SHIPPED_VERIFIERS[spec] if spec else None
    if ":" not in spec:
        raise EnvConfigError(f"unknown verifier `{spec}`; shipped: {', '.join(SHIPPED_VERIFIERS)}, or "
                             "`file.py:function` (answer, reference) -> float")
    return _from_file(spec, "task.env.verifier")


class EnvFactory:
    """Makes one environment per episode; holds what they share (an MCP server's session) until `close`."""

    def __init__(self, cfg: EnvConfig):
        self.cfg = cfg
        self.mcp: McpServer | None = None
        if cfg.kind == "class":
            self._cls = _from_file(cfg.path or "", "task.env.path")
            self._check_class()
            return
        if cfg.kind in ("verifiers", "openenv"):
            self._ecosystem()
            return
        tools = [load_tool(t) for t in cfg.tools]
        if cfg.mcp:
            self.mcp = McpServer(cfg.mcp, timeout_s=cfg.step_timeout_s)
            tools += self.mcp.tools()
        names = [t.spec.name for t in tools]
        if len(set(names)) != len(names):
            raise EnvConfigError(f"task.env: two tools share a name: {sorted(names)}")
        self._tools, self._verify = tools, load_verifier(cfg.verifier)

    def _check_class(self) -> None:
        try:
            env = self._cls(**self.cfg.args)
        except Exception as err:
            raise EnvConfigError(f"task.env.path `{self.cfg.path}` with args {self.cfg.args} cannot be made: "
                                 f"{type(err).__name__}: {err}") from None
        if not isinstance(env, Env):
            raise EnvConfigError(f"task.env.path `{self.cfg.path}` has no reset(prompt) and step(action) "
                                 "methods: see docs/environments.md")

    def _ecosystem(self) -> None:
        cfg = self.cfg
        try:
            if cfg.kind == "verifiers":
                self._vf = load_verifiers_env(cfg.name or "", cfg.args)
                self._vf_tools = tool_specs(self._vf)
            else:
                self._openenv = OpenEnvSpec(cfg.url or "", cfg.action_field, cfg.observation_field,
                                            cfg.args, cfg.step_timeout_s)
                self._openenv.check()
        except (VerifiersLoadError, OpenEnvError) as err:
            raise EnvConfigError(str(err)) from None

    def __call__(self) -> Env:
        if self.cfg.kind == "class":
            return self._cls(**self.cfg.args)
        if self.cfg.kind == "verifiers":
            return VerifiersEpisode(self._vf, self._vf_tools, self.cfg.step_timeout_s, self.cfg.max_turns)
        if self.cfg.kind == "openenv":
            return OpenEnvEpisode(self._openenv)
        return ToolEnv(self._tools, self._verify)

    def close(self) -> None:
        if self.mcp is not None:
            self.mcp.close()

"""An environment as an episode sees it: our small interface, and the call that keeps a failing one from
stalling the generator.

    reset(prompt) -> observation                    the episode's first user turn
    step(action)  -> observation, reward, done      action: the model's turn as text

An observation is a string (the next user message) or a list of chat messages (tool results: `{"role":
"tool", "content": ...}`). An environment may list `tools` (`ToolSpec`s): they are rendered into the
episode's first context, and the model calls them per `asyncrlhf.chat_format`. A `reset` that declares
a `reference` parameter (or `**kwargs`) receives the task's reference answer for the prompt.
"""

from __future__ import annotations

import inspect
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from enum import StrEnum
from typing import Any, Protocol, Self, TypeVar, runtime_checkable

from asyncrlhf.chat_format import Message, ToolSpec

Observation = str | list[Message]
T = TypeVar("T")


@runtime_checkable
class Env(Protocol):
    def reset(self, prompt: str) -> Observation: ...

    def step(self, action: str) -> tuple[Observation, float, bool]: ...


class EndKind(StrEnum):
    """Why an episode ended: the environment said so (`done`), a limit (`max_turns`; `length`: the episode's
    token budget or the model's context), or the environment failed (`error`, `timeout`, `malformed`)."""

    DONE = "done"
    MAX_TURNS = "max_turns"
    LENGTH = "length"
    ERROR = "error"
    TIMEOUT = "timeout"
    MALFORMED = "malformed"


@dataclass(frozen=True)
class EpisodeEnd:
    """Why an episode ended, with what happened where the environment failed (`detail`). Its one text form,
    what `Sample.episode_end` carries on the wire, is written by `str` ("kind", or "kind: detail") and read
    back by `parse`."""

    kind: EndKind
    detail: str = ""

    def __str__(self) -> str:
        return f"{self.kind.value}: {self.detail}" if self.detail else self.kind.value

    @classmethod
    def parse(cls, text: str) -> EpisodeEnd:
        """The end `str` wrote as `text`. Raises ValueError for any other text (empty included: an episode
        that has not ended has no end)."""
        kind, _, detail = text.partition(": ")
        try:
            return cls(EndKind(kind), detail)
        except ValueError:
            raise ValueError(f"{text!r} is not an episode's end: one of {', '.join(EndKind)}, with what "
                             "happened after a colon") from None


class EnvFailure(Exception):
    """The environment raised, hung or returned something malformed: its episode ends with `end` (made by
    `error`, `timeout` or `malformed`, with what happened)."""

    def __init__(self, end: EpisodeEnd):
        super().__init__(str(end))
        self.end = end

    @classmethod
    def error(cls, detail: str) -> Self:
        return cls(EpisodeEnd(EndKind.ERROR, detail))

    @classmethod
    def timeout(cls, detail: str) -> Self:
        return cls(EpisodeEnd(EndKind.TIMEOUT, detail))

    @classmethod
    def malformed(cls, detail: str) -> Self:
        return cls(EpisodeEnd(EndKind.MALFORMED, detail))


@dataclass(frozen=True)
class StepResult:
    messages: list[Message]
    reward: float
    done: bool
    seconds: float
    tool_calls: dict[str, int] = field(default_factory=dict)  # calls by tool (ToolEnv reports them)
    tool_errors: dict[str, int] = field(default_factory=dict)


def tools_of(env: object) -> list[ToolSpec]:
    tools = getattr(env, "tools", None) or []
    if not all(isinstance(t, ToolSpec) for t in tools):
        raise EnvFailure.malformed("the environment's `tools` must be ToolSpec objects")
    return list(tools)


def bounded(fn: Callable[[], T], timeout_s: float, what: str) -> T:
    """`fn()` on a thread of its own, waited for at most `timeout_s`. Raises EnvFailure when it raises or
    runs longer (a hung call's thread is left behind, as a daemon: Python cannot stop a thread, and the
    episode must not wait for it)."""
    box: dict[str, Any] = {}

    def run() -> None:
        try:
            box["value"] = fn()
        except BaseException as err:  # whatever the user's code raises ends its episode
            box["error"] = err

    thread = threading.Thread(target=run, name=f"env-{what}", daemon=True)
    thread.start()
    thread.join(timeout_s)
    if thread.is_alive():
        raise EnvFailure.timeout(f"{what} ran past task.env.step_timeout_s={timeout_s:g}")
    if "error" in box:
        err = box["error"]
        if isinstance(err, EnvFailure):  # an adapter's own account (the verifiers and OpenEnv ones)
            raise err
        raise EnvFailure.error(f"{what} raised {type(err).__name__}: {err}")
    return box["value"]


def as_messages(observation: object, what: str, roles: tuple[str, ...] = ("user", "tool", "system")
                ) -> list[Message]:
    """An observation as chat messages; `EnvFailure.malformed` when it is neither a string nor a
    list of {role, content} dicts with string content (the first observation may hold assistant messages:
    few-shot examples)."""
    if isinstance(observation, str):
        return [{"role": "user", "content": observation}]
    if isinstance(observation, list) and all(
            isinstance(m, dict) and m.get("role") in roles
            and isinstance(m.get("content"), str) for m in observation):
        return [dict(m) for m in observation]
    return _malformed(f"{what} returned {type(observation).__name__} {str(observation)[:60]!r}; expected "
                      "a string or a list of {role: user|tool, content: str} messages")


def _malformed(reason: str):
    raise EnvFailure.malformed(reason)


def reset(env: Env, prompt: str, reference: str | None, timeout_s: float) -> list[Message]:
    params = inspect.signature(env.reset).parameters.values()
    takes_reference = any(p.name == "reference" or p.kind is p.VAR_KEYWORD for p in params)
    kwargs = {"reference": reference} if takes_reference else {}
    first = bounded(lambda: env.reset(prompt, **kwargs), timeout_s, "reset")
    return as_messages(first, "reset", roles=("user", "tool", "system", "assistant"))


def step(env: Env, action: str, timeout_s: float) -> StepResult:
    start = time.perf_counter()
    out = bounded(lambda: env.step(action), timeout_s, "step")
    seconds = time.perf_counter() - start
    if not (isinstance(out, tuple) and len(out) == 3):
        _malformed(f"step returned {type(out).__name__} {str(out)[:60]!r}; expected "
                   "(observation, reward, done)")
    observation, reward, done = out
    if isinstance(reward, bool) or not isinstance(reward, int | float) or reward != reward:
        _malformed(f"step returned the reward {reward!r}; expected a number")
    messages = [] if done and observation in ("", None, []) else as_messages(observation, "step")
    report = getattr(env, "last_step_report", None)
    calls, errors = (report() if callable(report) else ({}, {}))
    return StepResult(messages, float(reward), bool(done), seconds, dict(calls), dict(errors))

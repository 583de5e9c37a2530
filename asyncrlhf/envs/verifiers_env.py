"""A `verifiers` environment (`task.env.kind: verifiers`) as an episode's environment, without re-tokenising.

The environment is loaded once per generator with `verifiers.load_environment(name, **args)`. Each episode
runs that environment's own `rollout` (its `env_response`, its `@vf.stop` conditions, `is_completed`,
`render_completion`, then `rubric.score_rollout` for the reward), on an event loop of its own, with a
client that answers each of the rollout's model calls (`client.chat.completions.create`) with the turn our
generator sampled: `reset` returns the rollout's first prompt (the environment's system prompt and few-shot
messages, then the task's prompt), and `step(action)` hands the turn's text over as the assistant's message
(its Hermes tool calls as OpenAI `tool_calls`) and returns what the environment appended after it, or the
rubric's reward once the rollout is complete. The token ids stay the sampled ones: verifiers only ever sees
the turn's text.

Tested against verifiers 0.1.10 (the `envs` extra), chat environments (`MultiTurnEnv`, `SingleTurnEnv`,
`ToolEnv`, ...). Whatever the environment raises, a rollout that hangs past `task.env.step_timeout_s`, an
error the environment stops on, or a conversation it rewrites ends the episode (`EnvFailure`).
"""

from __future__ import annotations

import asyncio
import logging
import queue
import signal
import threading
import time
import weakref
from typing import Any

from asyncrlhf.chat_format import Message, ToolSpec, parse_tool_calls
from asyncrlhf.envs.base import EnvFailure, as_messages
from asyncrlhf.envs.tools import MALFORMED

MODEL = "asyncrlhf-policy"  # the model name the rollout's calls carry
log = logging.getLogger(__name__)


class VerifiersLoadError(ValueError):
    """The verifiers environment cannot be loaded; the message says what to do."""


def load_verifiers_env(name: str, args: dict[str, Any]) -> Any:
    """`verifiers.load_environment(name, **args)`, keeping this process's SIGINT/SIGTERM handlers (a
    verifiers Environment installs its own, which would take the generator's graceful stop away)."""
    try:
        import verifiers as vf
    except ImportError:
        raise VerifiersLoadError("task.env.kind `verifiers` needs the verifiers package: "
                                 "pip install 'asyncrlhf[envs]'") from None
    handlers = {s: signal.getsignal(s) for s in (signal.SIGINT, signal.SIGTERM)}
    try:
        env = vf.load_environment(name, **args)
    except Exception as err:  # verifiers wraps an import failure in ValueError, the rest in RuntimeError
        raise VerifiersLoadError(f"task.env.name `{name}` with args {args}: {err} (a verifiers environment "
                                 "is a module with a load_environment function, installed or on the "
                                 "Python path)") from None
    finally:
        if threading.current_thread() is threading.main_thread():
            for sig, handler in handlers.items():
                signal.signal(sig, handler)
    if getattr(env, "message_type", "chat") != "chat":
        raise VerifiersLoadError(f"task.env.name `{name}` is a completion environment (message_type "
                                 f"{env.message_type!r}); episodes take chat environments")
    log.info("verifiers environment %s loaded (%s, verifiers %s), tools: %s", name, type(env).__name__,
             vf.__version__, [t["function"]["name"] for t in getattr(env, "oai_tools", None) or []] or "none")
    return env


def tool_specs(env: Any) -> list[ToolSpec]:
    """The environment's tools (`oai_tools`, OpenAI's shape) as our ToolSpecs."""
    out = []
    for tool in getattr(env, "oai_tools", None) or []:
        fn = tool["function"]
        out.append(ToolSpec(fn["name"], fn.get("description") or "",
                            fn.get("parameters") or {"type": "object", "properties": {}}))
    return out


class _TurnsSpent(Exception):
    """Raised into the rollout when task.env.max_turns is reached: it ends (verifiers records it as a
    model error) and is scored as it stands."""


class _Bridge:
    """Between the rollout's event loop and the episode's threads: the rollout posts what it asks for on
    `asks` (("turn", prompt messages), ("done", state) or ("error", exception)); the episode answers each
    turn on `answers` (the model's text, or _TurnsSpent)."""

    def __init__(self) -> None:
        self.asks: queue.Queue = queue.Queue()
        self.answers: asyncio.Queue = asyncio.Queue()
        self.loop = asyncio.new_event_loop()
        self.task: asyncio.Task | None = None
        self.thread: threading.Thread | None = None

    async def create(self, *, messages: list[Message], **_: Any):
        """`client.chat.completions.create`, as the rollout calls it."""
        self.asks.put(("turn", list(messages)))
        answer = await self.answers.get()
        if isinstance(answer, BaseException):
            raise answer
        return _completion(answer)

    async def drive(self, env: Any, rollout_input: dict[str, Any]) -> None:
        try:
            state = await env.rollout(rollout_input, _Client(self), MODEL, None)
            if env.score_rollouts:
                await env.rubric.score_rollout(state)
            else:
                await env.rubric.dummy_score_rollout(state)
        except asyncio.CancelledError:
            raise
        except BaseException as err:  # the environment's failure, reported to its episode
            self.asks.put(("error", err))
            return
        self.asks.put(("done", state))

    def start(self, env: Any, rollout_input: dict[str, Any]) -> None:
        """The rollout on the loop, on a thread of its own (the task exists before the thread starts, so a
        cancel always finds it)."""
        task = self.task = self.loop.create_task(self.drive(env, rollout_input))

        def run() -> None:
            try:
                self.loop.run_until_complete(task)
            except BaseException:  # cancelled: the episode ended first
                pass
            finally:
                self.loop.close()

        self.thread = threading.Thread(target=run, name="verifiers-rollout", daemon=True)
        self.thread.start()

    def answer(self, value: str | BaseException) -> None:
        self.loop.call_soon_threadsafe(self.answers.put_nowait, value)


def _cancel(bridge: _Bridge) -> None:
    """Stop a rollout still running (its episode ended first, or was dropped); its cleanup handlers run."""
    if bridge.task is not None and not bridge.task.done():
        try:
            bridge.loop.call_soon_threadsafe(bridge.task.cancel)
        except RuntimeError:  # the loop already closed
            pass


class _Client:
    """The parts of `openai.AsyncOpenAI` a chat rollout calls."""

    def __init__(self, bridge: _Bridge):
        completions = type("Completions", (), {"create": staticmethod(bridge.create)})()
        self.chat = type("Chat", (), {"completions": completions})()


def _completion(text: str):
    """The model's turn as the ChatCompletion verifiers parses: its text outside the tool calls, and its
    well-formed Hermes calls as `tool_calls` (a turn with a malformed call keeps its whole text)."""
    from openai.types.chat import ChatCompletion

    turn = parse_tool_calls(text)
    message: dict[str, Any] = {"role": "assistant", "content": text if turn.errors else turn.content}
    if turn.calls:
        message["tool_calls"] = [c.openai() for c in turn.calls]
    return ChatCompletion.model_validate({
        "id": "asyncrlhf", "object": "chat.completion", "created": int(time.time()), "model": MODEL,
        "choices": [{"index": 0, "message": message,
                     "finish_reason": "tool_calls" if turn.calls else "stop"}]})


class VerifiersEpisode:
    """One episode of a verifiers environment, by our interface (`asyncrlhf.envs.base`)."""

    def __init__(self, env: Any, tools: list[ToolSpec], timeout_s: float, max_turns: int):
        self.env, self.tools = env, tools
        self.timeout_s, self.max_turns = timeout_s, max_turns
        self._bridge = _Bridge()
        self._context: list[Message] = []  # the rollout's last prompt, then the turn we answered it with
        self._turns = 0
        self._calls: dict[str, int] = {}
        self._errors: dict[str, int] = {}
        weakref.finalize(self, _cancel, self._bridge)

    def reset(self, prompt: str, reference: str | None = None) -> list[Message]:
        env = self.env
        system = [{"role": "system", "content": env.system_prompt}] if env.system_prompt else []
        messages: list[Message] = [*system, *(env.few_shot or []), {"role": "user", "content": prompt}]
        rollout_input = {"prompt": messages, "answer": reference or "", "example_id": 0,
                         "task": env.env_id or "default"}
        self._bridge.start(env, rollout_input)
        kind, value = self._next("reset")
        if kind != "turn":
            raise EnvFailure.error("the verifiers rollout ended before the model's first turn"
                             + _stopped(value))
        self._context = value
        return value

    def step(self, action: str) -> tuple[list[Message], float, bool]:
        self._turns += 1
        self._count(action)
        self._bridge.answer(action)
        try:
            return self._outcome()
        except EnvFailure:
            self.close()  # the rollout may still wait for a turn: it is stopped, not left behind
            raise

    def _outcome(self) -> tuple[list[Message], float, bool]:
        kind, value = self._next("step")
        if kind == "turn" and self._turns >= self.max_turns:  # our limit: score the rollout as it stands
            self._bridge.answer(_TurnsSpent("task.env.max_turns reached"))
            kind, value = self._next("step")
            if kind == "done":
                return [], _reward(value), False
        if kind == "done":
            return [], _reward(value, allow_error=False), True
        known = len(self._context) + 1
        if value[: len(self._context)] != self._context or len(value) < known:
            raise EnvFailure.malformed("the verifiers environment rewrote the conversation (episodes "
                             "append to the sampled tokens; a rollout's prompt must extend the last one)")
        self._context = list(value)
        return as_messages(value[known:], "the verifiers environment's response"), 0.0, False

    def _next(self, what: str) -> tuple[str, Any]:
        try:
            kind, value = self._bridge.asks.get(timeout=self.timeout_s)
        except queue.Empty:
            _cancel(self._bridge)
            raise EnvFailure.timeout(f"the verifiers rollout's {what} ran past "
                             f"task.env.step_timeout_s={self.timeout_s:g}") from None
        if kind == "error":
            raise EnvFailure.error(f"the verifiers rollout raised {type(value).__name__}: {value}")
        return kind, value

    def _count(self, action: str) -> None:
        turn = parse_tool_calls(action)
        self._calls, self._errors = {}, {}
        for call in turn.calls:
            self._calls[call.name] = self._calls.get(call.name, 0) + 1
        if turn.errors:
            self._calls[MALFORMED] = self._errors[MALFORMED] = len(turn.errors)

    def last_step_report(self) -> tuple[dict[str, int], dict[str, int]]:
        """Calls by tool in the last step, and malformed calls (a tool's own failure goes back to the
        model as the environment formats it, uncounted)."""
        return self._calls, self._errors

    def close(self) -> None:
        _cancel(self._bridge)


def _stopped(state: Any) -> str:
    error = state.get("error") if isinstance(state, dict) else None
    return f": {type(error).__name__}: {error}" if error is not None else ""


def _reward(state: Any, allow_error: bool = True) -> float:
    """The rubric's reward of a finished rollout. A rollout the environment stopped on an error of its own
    (a tool error it stops for, a failed setup) is the environment's failure; one stopped because the model
    said nothing, or because task.env.max_turns was reached, is scored."""
    error = state.get("error")
    if error is not None and not allow_error and not _models_fault(error):
        raise EnvFailure.error(f"the verifiers environment stopped on {type(error).__name__}: {error}")
    reward = state.get("reward")
    if isinstance(reward, bool) or not isinstance(reward, int | float) or reward != reward:
        raise EnvFailure.malformed(f"the verifiers rubric gave the reward {reward!r}; expected a number")
    return float(reward)


def _models_fault(error: BaseException) -> bool:
    import verifiers as vf

    return isinstance(error, vf.EmptyModelResponseError) or isinstance(error.__cause__, _TurnsSpent)

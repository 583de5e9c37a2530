"""An OpenEnv environment (`task.env.kind: openenv`): each episode is a session of an OpenEnv server that you
started (`task.env.url`), spoken to over its WebSocket protocol by this small client, not by `openenv-core`
(whose package pulls gradio and fastmcp):

    connect  {url}/ws                   one session, one environment instance on the server
    send     {"type": "reset", "data": {...task.env.args, "prompt": ..., "reference": ...}}
    send     {"type": "step", "data": {<task.env.action_field>: <the model's turn text>}}
    receive  {"type": "observation", "data": {"observation": {...}, "reward": r | null, "done": bool}}
             or {"type": "error", "data": {"message": ..., "code": ...}}
    send     {"type": "close"}           when the episode ends

(openenv-core 0.3's `EnvClient` and `HTTPEnvServer`; a server passes only the reset arguments its
environment's `reset` declares, so `prompt` and `reference` reach only the environments that take them.)
The observation shown to the model is its `task.env.observation_field`, or its only string field, or the
observation as JSON; the first one, if empty, is the task's prompt. A server that answers an error, closes,
answers past `task.env.step_timeout_s` or answers something else ends the episode (`EnvFailure`).
"""

from __future__ import annotations

import json
import weakref
from dataclasses import dataclass, field
from typing import Any
from urllib.parse import urlsplit, urlunsplit

from asyncrlhf.envs.base import EnvFailure

MAX_MESSAGE_BYTES = 16 * 1024 * 1024
CLOSE_WAIT_S = 0.5  # for the server to close a session we ended


class OpenEnvError(ValueError):
    """`task.env` names an OpenEnv server that cannot be used; the message says what to do."""


@dataclass(frozen=True)
class OpenEnvSpec:
    url: str
    action_field: str = "message"
    observation_field: str | None = None
    reset_args: dict[str, Any] = field(default_factory=dict)
    timeout_s: float = 10.0

    def endpoint(self, ws: bool) -> str:
        """The server's base URL as ws(s):// with /ws (`ws`), or as http(s)://."""
        parts = urlsplit(self.url.rstrip("/"))
        secure = parts.scheme in ("https", "wss")
        scheme = ("wss" if secure else "ws") if ws else ("https" if secure else "http")
        return urlunsplit((scheme, parts.netloc, parts.path + ("/ws" if ws else ""), "", ""))

    def check(self) -> None:
        """The client library is there and the server answers its health check."""
        try:
            import websockets.sync.client  # noqa: F401
        except ImportError:
            raise OpenEnvError("task.env.kind `openenv` needs the websockets package: "
                               "pip install 'asyncrlhf[envs]'") from None
        import httpx

        health = f"{self.endpoint(ws=False)}/health"
        try:
            httpx.get(health, timeout=self.timeout_s).raise_for_status()
        except httpx.HTTPError as err:
            raise OpenEnvError(f"task.env.url: the OpenEnv server does not answer {health} ({err}); start "
                               "it first (e.g. uvicorn my_env.server.app:app --port 8000)") from None


class OpenEnvEpisode:
    """One episode: one session of the server, opened by `reset`, closed when the episode ends."""

    def __init__(self, spec: OpenEnvSpec):
        self.spec = spec
        self._conn: Any = None
        self._finalizer: weakref.finalize | None = None

    def reset(self, prompt: str, reference: str | None = None) -> str:
        from websockets.sync.client import connect

        url = self.spec.endpoint(ws=True)
        try:
            self._conn = connect(url, open_timeout=self.spec.timeout_s, max_size=MAX_MESSAGE_BYTES)
        except Exception as err:  # refused, handshake failed, timed out: this episode's end
            raise EnvFailure.error(f"cannot open a session at {url}: {type(err).__name__}: {err}") from None
        self._finalizer = weakref.finalize(self, _close, self._conn)
        data = {**self.spec.reset_args, "prompt": prompt}
        if reference is not None:
            data["reference"] = reference
        text, _, _ = self._exchange({"type": "reset", "data": data}, "reset")
        return text or prompt

    def step(self, action: str) -> tuple[str, float, bool]:
        if self._conn is None:
            raise EnvFailure.error("step before reset")
        message = {"type": "step", "data": {self.spec.action_field: action}}
        text, reward, done = self._exchange(message, "step")
        if done:
            self.close()
        return text, reward, done

    def _exchange(self, message: dict[str, Any], what: str) -> tuple[str, float, bool]:
        try:
            self._conn.send(json.dumps(message))
            raw = self._conn.recv(timeout=self.spec.timeout_s)
        except TimeoutError:
            self.close()
            raise EnvFailure.timeout(f"the OpenEnv server's {what} ran past task.env.step_timeout_s="
                             f"{self.spec.timeout_s:g}") from None
        except Exception as err:  # the session closed or broke
            self.close()
            raise EnvFailure.error(f"the OpenEnv session broke in {what}: {type(err).__name__}: "
                             f"{err}") from None
        try:
            return self._parse(raw, what)
        except EnvFailure:
            self.close()
            raise

    def _parse(self, raw: str | bytes, what: str) -> tuple[str, float, bool]:
        try:
            reply = json.loads(raw)
        except ValueError:
            raise EnvFailure.malformed(f"the OpenEnv server answered {what} with {str(raw)[:60]!r}, not "
                             "JSON") from None
        kind, data = (reply.get("type"), reply.get("data")) if isinstance(reply, dict) else (None, None)
        if kind == "error" and isinstance(data, dict):
            raise EnvFailure.error(f"the OpenEnv server's {what} failed: {data.get('message')} "
                             f"({data.get('code')})")
        observation = data.get("observation") if isinstance(data, dict) else None
        if kind != "observation" or not isinstance(observation, dict):
            raise EnvFailure.malformed(f"the OpenEnv server answered {what} with {str(reply)[:80]!r}; "
                             "expected {type: observation, data: {observation: {...}, reward, done}}")
        reward, done = reply["data"].get("reward"), reply["data"].get("done", False)
        if reward is None:
            reward = 0.0
        if not isinstance(reward, int | float) or reward != reward or not isinstance(done, bool):
            raise EnvFailure.malformed(f"the OpenEnv server's {what} gave reward {reward!r}, done "
                             f"{done!r}; expected a number and a boolean")
        return self._text(observation, what), float(reward), done

    def _text(self, observation: dict[str, Any], what: str) -> str:
        name = self.spec.observation_field
        if name is not None:
            if name not in observation:
                raise EnvFailure.malformed(f"the OpenEnv {what} observation has no field `{name}` "
                                 f"(task.env.observation_field); it has {sorted(observation)}")
            value = observation[name]
            return value if isinstance(value, str) else json.dumps(value)
        strings = [v for v in observation.values() if isinstance(v, str)]
        return strings[0] if len(strings) == 1 else json.dumps(observation) if observation else ""

    def close(self) -> None:
        """End the session (the server frees its environment)."""
        if self._finalizer is not None:
            self._finalizer()


def _close(conn: Any) -> None:
    """Ask the server to end the session and let it close the connection (closing it from both ends at
    once makes openenv-core's server log a disconnect error), then close this end."""
    try:
        conn.send(json.dumps({"type": "close"}))
        conn.recv(timeout=CLOSE_WAIT_S)
    except Exception:  # closed by the server, as asked, or gone already
        pass
    try:
        conn.close()
    except Exception:  # a connection already broken has nothing left to close
        pass

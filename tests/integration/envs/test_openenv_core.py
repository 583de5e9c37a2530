"""The OpenEnv adapter against openenv-core's own server (`create_app`, its `HTTPEnvServer`), where
openenv-core is installed: it is not an asyncrlhf dependency (it pulls gradio and fastmcp), so CI runs the
same protocol against `openenv_server.py` (test_openenv.py) and this file skips there."""

from __future__ import annotations

import socket
import threading
import time

import pytest

pytest.importorskip("websockets", reason="the websockets package (pip install 'asyncrlhf[envs]')")
pytest.importorskip("openenv.core.env_server.http_server", reason="openenv-core is not installed")
import uvicorn
from openenv.core.env_server.http_server import create_app
from openenv.core.env_server.interfaces import Environment
from openenv.core.env_server.types import Action, Observation, State

from asyncrlhf.config import EnvConfig
from asyncrlhf.envs import base
from asyncrlhf.envs.base import EnvFailure
from asyncrlhf.envs.loading import EnvFactory

pytestmark = pytest.mark.integration


class GuessAction(Action):
    message: str


class GuessObservation(Observation):
    prompt: str = ""


class Guess(Environment):
    SUPPORTS_CONCURRENT_SESSIONS = True

    def __init__(self):
        super().__init__()
        self.secret, self._state = 7, State(episode_id="e", step_count=0)

    def reset(self, seed=None, episode_id=None, prompt=None, **kwargs):
        self.secret = 7 if seed is None else seed
        return GuessObservation(prompt=f"Guess 1-10. {prompt}", done=False, reward=None)

    def step(self, action, timeout_s=None, **kwargs):
        if "boom" in action.message:
            raise RuntimeError("kaboom")
        right = str(self.secret) in action.message
        return GuessObservation(prompt="Right!" if right else "Wrong", done=right, reward=float(right))

    @property
    def state(self):
        return self._state


@pytest.fixture(scope="module")
def url():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    app = create_app(Guess, GuessAction, GuessObservation, max_concurrent_envs=8)
    server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=port, log_level="warning"))
    threading.Thread(target=server.run, daemon=True).start()
    while not server.started:
        time.sleep(0.05)
    yield f"http://127.0.0.1:{port}"
    server.should_exit = True


def test_episodes_against_openenv_cores_server(url):
    make = EnvFactory(EnvConfig(kind="openenv", url=url, args={"seed": 3}))
    env = make()
    first = base.reset(env, "task prompt", "3", 5.0)
    assert first == [{"role": "user", "content": "Guess 1-10. task prompt"}]
    wrong = base.step(env, "5", 5.0)
    assert (wrong.messages[0]["content"], wrong.reward, wrong.done) == ("Wrong", 0.0, False)
    assert base.step(env, "3", 5.0).reward == 1.0
    failing = make()
    base.reset(failing, "p", None, 5.0)
    with pytest.raises(EnvFailure, match="error: the OpenEnv server's step failed: kaboom"):
        base.step(failing, "boom", 5.0)
    many = [make() for _ in range(8)]  # as many sessions at once as the server allows
    assert all(base.reset(e, "p", None, 5.0) for e in many)

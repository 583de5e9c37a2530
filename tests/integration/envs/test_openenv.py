"""`task.env.kind: openenv`: episodes as sessions of an OpenEnv server over its WebSocket protocol, against a
real server of that protocol run in-process (`openenv_server.py`, uvicorn); every way a session can fail
ends its episode (EnvFailure) and closes the session."""

from __future__ import annotations

import time

import pytest

from asyncrlhf.config import EnvConfig
from asyncrlhf.envs import base
from asyncrlhf.envs.base import EnvFailure
from asyncrlhf.envs.loading import EnvConfigError, EnvFactory

pytest.importorskip("websockets", reason="the websockets package (pip install 'asyncrlhf[envs]')")
from tests.integration.envs import openenv_server

pytestmark = pytest.mark.integration


@pytest.fixture(scope="module")
def url():
    url, server = openenv_server.serve()
    yield url
    server.should_exit = True


def factory(url, **cfg):
    return EnvFactory(EnvConfig(kind="openenv", url=url, **{"step_timeout_s": 2.0, **cfg}))


def closed_sessions(before: int, expected: int) -> bool:
    deadline = time.monotonic() + 5
    while openenv_server.SESSIONS["closed"] - before < expected and time.monotonic() < deadline:
        time.sleep(0.05)
    return openenv_server.SESSIONS["closed"] - before == expected


def test_an_episode_is_a_session_until_done(url):
    before = openenv_server.SESSIONS["closed"]
    env = factory(url, observation_field="prompt")()
    first = base.reset(env, "Think hard.", "7", 5.0)
    assert first == [{"role": "user", "content": "Guess a number from 1 to 10. Think hard."}]
    wrong = base.step(env, "3", 5.0)
    assert wrong.messages == [{"role": "user", "content": "Wrong, try again."}]
    assert (wrong.reward, wrong.done) == (0.0, False)
    right = base.step(env, "It is 7.", 5.0)
    assert (right.reward, right.done) == (1.0, True)
    assert closed_sessions(before, 1)  # done: the session was closed


def test_reset_args_reach_the_server_and_the_observation_shows_as_json_without_a_field(url):
    env = factory(url, args={"seed": 4})()
    first = base.reset(env, "p", None, 5.0)[0]["content"]
    # two string fields and no task.env.observation_field: the observation as JSON
    assert first == '{"prompt": "Guess a number from 1 to 10. p", "round": 1, "hint": "a whole number"}'
    assert base.step(env, "4", 5.0).done


@pytest.mark.parametrize("cue, reason", [
    ("boom", "error: the OpenEnv server's step failed: the game crashed (EXECUTION_ERROR)"),
    ("hang", "timeout: "),  # the adapter's wait or base.bounded's, whichever ends first: both 2 s
    ("junk", "malformed: the OpenEnv server answered step with '<html>oops</html>', not JSON"),
    ("drop", "error: the OpenEnv session broke in step: ConnectionClosed"),
    ("odd", "malformed: the OpenEnv server's step gave reward 'high'"),
])
def test_each_failure_of_the_server_is_an_env_failure_and_closes_the_session(url, cue, reason):
    before = openenv_server.SESSIONS["closed"]
    env = factory(url)()
    base.reset(env, cue, None, 5.0)
    with pytest.raises(EnvFailure) as failure:
        base.step(env, "3", 2.0)
    assert str(failure.value).startswith(reason), failure.value.end
    if cue == "hang":  # the adapter's own wait ends and closes the session (the hung server cannot tell)
        time.sleep(2.5)
        assert not env._finalizer.alive
    else:
        assert closed_sessions(before, 1)


def test_a_wrong_action_field_is_the_servers_error(url):
    env = factory(url, action_field="text")()
    base.reset(env, "p", None, 5.0)
    with pytest.raises(EnvFailure, match="action has no field `message`"):
        base.step(env, "7", 5.0)


def test_a_dropped_episode_closes_its_session(url):
    before = openenv_server.SESSIONS["closed"]
    env = factory(url)()
    base.reset(env, "p", None, 5.0)
    del env
    assert closed_sessions(before, 1)


def test_a_server_that_is_not_there_is_a_config_error(url):
    with pytest.raises(EnvConfigError, match="does not answer http://127.0.0.1:9/health.*start it first"):
        factory("http://127.0.0.1:9")
    with pytest.raises(ValueError, match="needs task.env.url"):
        EnvConfig(kind="openenv", url="127.0.0.1:8000")
    env = factory(url)()
    env.spec = env.spec.__class__("ws://127.0.0.1:9")  # the server went away after the generator started
    with pytest.raises(EnvFailure, match="error: cannot open a session at ws://127.0.0.1:9/ws"):
        base.reset(env, "p", None, 5.0)

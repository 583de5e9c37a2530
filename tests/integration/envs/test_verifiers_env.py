"""`task.env.kind: verifiers`: a real verifiers environment (the `envs` extra) loaded by
`verifiers.load_environment`, its own rollout driven turn by turn with the text our generator sampled; the
shipped `asyncrlhf.envs.vf_arithmetic` (a verifiers ToolEnv) and `vf_scripted` (one that fails on cue)."""

from __future__ import annotations

import gc
import signal

import pytest

from asyncrlhf.chat_format import ToolCall
from asyncrlhf.config import EnvConfig, load_config
from asyncrlhf.envs import base
from asyncrlhf.envs.base import EnvFailure
from asyncrlhf.envs.episode import EpisodeLimits, EpisodeRunner
from asyncrlhf.envs.loading import EnvConfigError, EnvFactory
from asyncrlhf.models import load_policy, load_tokenizer
from asyncrlhf.sampling import create_backend
from asyncrlhf.version import PolicyVersion

pytest.importorskip("verifiers", reason="the verifiers package (pip install 'asyncrlhf[envs]')")
pytestmark = pytest.mark.integration
SCRIPTED = "tests.integration.envs.vf_scripted"
CALC = ToolCall("calculator", {"expression": "6 * 7"}).text()


def factory(name=SCRIPTED, **cfg):
    return EnvFactory(EnvConfig(kind="verifiers", name=name, **{"step_timeout_s": 2.0, **cfg}))


@pytest.fixture(scope="module")
def arithmetic():
    return factory("asyncrlhf.envs.vf_arithmetic", args={"max_turns": 3}, max_turns=3)


@pytest.fixture(scope="module")
def scripted():
    return factory(max_turns=4)


def test_a_tool_env_runs_the_calls_and_its_rubric_scores_the_answer(arithmetic):
    env = arithmetic()
    assert [t.name for t in env.tools] == ["calculator"]
    first = base.reset(env, "What is 6 * 7?", "42", 5.0)
    assert [m["role"] for m in first] == ["system", "user"] and first[1]["content"] == "What is 6 * 7?"
    called = base.step(env, f"Let me compute. {CALC}", 5.0)
    assert [(m["role"], m["content"]) for m in called.messages] == [("tool", "42")]
    assert not called.done and called.tool_calls == {"calculator": 1} and called.tool_errors == {}
    answered = base.step(env, "The answer is 42.", 5.0)
    assert answered.done and answered.reward == 1.0 and answered.messages == []
    wrong = arithmetic()
    base.reset(wrong, "What is 6 * 7?", "42", 5.0)
    assert base.step(wrong, "41", 5.0).reward == 0.0


def test_a_malformed_call_is_counted_and_the_empty_turn_is_scored(arithmetic):
    env = arithmetic()
    base.reset(env, "What is 6 * 7?", "42", 5.0)
    result = base.step(env, "<tool_call>{oops</tool_call>", 5.0)  # no call verifiers can run: the answer
    assert result.done and result.reward == 0.0 and result.tool_errors == {"<malformed>": 1}
    silent = arithmetic()
    base.reset(silent, "What is 6 * 7?", "42", 5.0)
    assert base.step(silent, "", 5.0).done  # verifiers stops on an empty turn: the model's doing, scored


def test_multi_turn_until_the_environment_is_done(scripted):
    env = scripted()
    assert base.reset(env, "What is 1 + 1?", "2", 5.0) == [{"role": "user", "content": "What is 1 + 1?"}]
    assert base.step(env, "3", 5.0).messages == [{"role": "user", "content": "obs 1"}]
    assert base.step(env, "4", 5.0).messages == [{"role": "user", "content": "obs 2"}]
    last = base.step(env, "2", 5.0)  # the environment's own max_turns (3)
    assert last.done and last.reward == 1.0


def test_task_env_max_turns_scores_the_rollout_as_it_stands():
    env = factory(max_turns=2)()
    base.reset(env, "What is 1 + 1?", "2", 5.0)
    base.step(env, "3", 5.0)
    cut = base.step(env, "it is 2", 5.0)  # the runner ends the episode as max_turns; the reward is kept
    assert not cut.done and cut.reward == 1.0 and cut.messages == []


@pytest.mark.parametrize("prompt, reason", [
    ("boom", "error: the verifiers rollout raised RuntimeError: the sandbox died"),
    ("hang", "timeout: "),  # the adapter's wait or base.bounded's, whichever ends first: both 2 s
    ("junk", "malformed: the verifiers environment's response returned list"),
    ("rewrite", "malformed: the verifiers environment rewrote the conversation"),
    ("stop", "error: the verifiers environment stopped on ToolCallError"),
])
def test_each_failure_of_the_environment_is_an_env_failure(scripted, prompt, reason):
    env = scripted()
    base.reset(env, prompt, "2", 5.0)
    with pytest.raises(EnvFailure) as failure:
        base.step(env, "3", 2.0)
    assert str(failure.value).startswith(reason), failure.value.end
    env._bridge.thread.join(5.0)  # the rollout was stopped (or ended): no thread left behind
    assert not env._bridge.thread.is_alive()


def test_a_dropped_episode_stops_its_rollout(scripted):
    env = scripted()
    base.reset(env, "What is 1 + 1?", "2", 5.0)
    base.step(env, "3", 5.0)  # the rollout now waits for a model turn that will never come
    thread = env._bridge.thread
    del env
    gc.collect()
    thread.join(5.0)
    assert not thread.is_alive()


def test_loading_keeps_the_process_signal_handlers():
    def mine(signum, frame):
        pass

    before = signal.signal(signal.SIGTERM, mine)
    try:
        factory()
        assert signal.getsignal(signal.SIGTERM) is mine
    finally:
        signal.signal(signal.SIGTERM, before)


def test_an_unknown_environment_is_a_config_error():
    with pytest.raises(EnvConfigError, match="task.env.name `no_such_vf_env`.*load_environment"):
        factory("no_such_vf_env")
    with pytest.raises(ValueError, match="needs task.env.name"):
        EnvConfig(kind="verifiers")


def test_a_failing_verifiers_env_ends_only_its_own_episode(scripted):
    """Episodes on the tiny model's HF backend: the "boom" prompt's episodes fail at their first step, the
    other prompt's run until the environment is done; the sampled ids are the trained ones."""
    cfg = load_config(["configs/tiny.yaml"], ["generator.device=cpu"])
    tokenizer = load_tokenizer(cfg.model)
    backend = create_backend(cfg, tokenizer)
    backend.apply_weights(load_policy(cfg.model).state_dict(), version=PolicyVersion(0, 1))

    def sample(contexts, max_tokens):
        sampling = cfg.generator.sampling.model_copy(update={"max_new_tokens": max_tokens})
        return [group[0] for group in backend.generate(contexts, 1, sampling)], backend.version

    limits = EpisodeLimits(max_turns=4, max_episode_tokens=200, max_turn_tokens=6, step_timeout_s=5.0,
                           max_positions=512)
    bad, good = EpisodeRunner(tokenizer, scripted, limits).run([("boom", None), ("count", "2")], 2, sample)
    assert all(str(e.end).startswith("error: the verifiers rollout raised") for e in bad), bad
    for e in good:
        assert str(e.end) in ("done", "length"), e.end
        assert e.turns == 3 or str(e.end) == "length"
        assert len(e.token_ids) == len(e.loss_mask) == len(e.logprobs)
        assert sum(e.loss_mask) > 0 and 0 in e.loss_mask  # the model's turns and the observations between

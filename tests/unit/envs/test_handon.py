"""Partial episodes handed on and continued elsewhere (`asyncrlhf.envs.handon`), on the tiny model's real HF
backend: a transcript cut mid-turn or with a step pending is replayed into a fresh environment and goes on
from exactly where it stopped; an environment that answers differently on the replay, or opens differently,
makes the episode start again; an ended episode is carried as it is."""

from __future__ import annotations

import pytest

from asyncrlhf._proto.rollout_pb2 import Sample
from asyncrlhf.envs.base import EndKind, EpisodeEnd
from asyncrlhf.envs.episode import Episode, EpisodeRunner
from asyncrlhf.envs.handon import Turn, partial_sample, resume
from tests.unit.envs import scripted
from tests.unit.envs.test_episodes import LIMITS, Recorder, tiny  # noqa: F401 - the module's engine fixture

pytestmark = pytest.mark.unit


def episode_of(tiny, env_cls) -> tuple[EpisodeRunner, Episode]:  # noqa: F811
    cfg, tokenizer, backend = tiny
    runner = EpisodeRunner(tokenizer, env_cls, LIMITS)
    ((episode,),) = runner.run([("hi", None)], 1, Recorder(cfg, backend))
    assert str(episode.end) == "done" and episode.turns == 3
    return runner, episode


def turn_start(e: Episode, i: int) -> int:
    """Where model turn i begins: after the prompt, or at the first model token after turn i-1's end."""
    return 0 if i == 0 else next(j for j in range(e.turn_ends[i - 1], len(e.token_ids)) if e.loss_mask[j])


def cut(e: Episode, end: int, turns: int, steps: int) -> Sample:
    """The transcript as a generator stopped at token `end`: `turns` turns ended, `steps` steps returned."""
    return Sample(completion_token_ids=e.token_ids[:end], logprobs=e.logprobs[:end],
                  token_versions=e.versions[:end], loss_mask=e.loss_mask[:end], turns=turns,
                  turn_ends=e.turn_ends[:turns], turn_rewards=e.turn_rewards[:steps],
                  episode_context_ids=e.prompt_ids)


def test_an_episode_cut_mid_turn_goes_on_from_its_tokens(tiny):  # noqa: F811
    runner, e = episode_of(tiny, scripted.Counter)
    start = turn_start(e, 1)
    sample = cut(e, start + 2, turns=1, steps=1)  # turn 1's step returned, two tokens of turn 2 sampled
    resumed = resume(runner, sample, "hi", None)
    assert resumed is not None and resumed.pending is None
    assert resumed.episode.token_ids == e.token_ids[:start]  # the replayed observation is the recorded one
    assert resumed.episode.versions == e.versions[:start] and resumed.episode.logprobs == e.logprobs[:start]
    assert resumed.turn.token_ids == e.token_ids[start:start + 2]
    assert (resumed.episode.turns, resumed.episode.turn_rewards) == (1, [0.0])
    assert resumed.episode.continued_from == start + 2
    again = partial_sample(resumed.episode, resumed.turn)  # handed on again: the same transcript
    assert list(again.completion_token_ids) == list(sample.completion_token_ids)
    assert list(again.loss_mask) == list(sample.loss_mask) and list(again.turn_ends) == list(sample.turn_ends)


def test_an_episode_handed_on_with_its_step_pending_runs_that_step_here(tiny):  # noqa: F811
    runner, e = episode_of(tiny, scripted.Counter)
    sample = cut(e, e.turn_ends[1], turns=2, steps=1)  # turn 2 ended; its step had not returned
    resumed = resume(runner, sample, "hi", None)
    assert resumed is not None and resumed.turn.token_ids == []
    _, tokenizer, _ = tiny
    start = turn_start(e, 1)
    assert resumed.pending == tokenizer.decode(e.token_ids[start:e.turn_ends[1]], skip_special_tokens=True)
    assert resumed.episode.token_ids == e.token_ids[:e.turn_ends[1]] and resumed.episode.turns == 2
    assert resumed.episode.env is not None and resumed.episode.env.seen == 1  # replayed: one step taken


def test_an_environment_that_answers_differently_on_the_replay_starts_the_episode_again(tiny):  # noqa: F811
    runner, e = episode_of(tiny, scripted.Drifting)
    assert resume(runner, cut(e, turn_start(e, 1) + 1, turns=1, steps=1), "hi", None) is None


def test_an_environment_that_opens_differently_starts_the_episode_again(tiny):  # noqa: F811
    runner, e = episode_of(tiny, scripted.Counter)
    assert resume(runner, cut(e, turn_start(e, 1) + 1, turns=1, steps=1), "another prompt", None) is None


def test_a_malformed_transcript_starts_the_episode_again(tiny):  # noqa: F811
    runner, e = episode_of(tiny, scripted.Counter)
    sample = cut(e, turn_start(e, 1) + 1, turns=1, steps=1)
    sample.turn_ends[0] += 1  # a turn end on an observation token
    assert resume(runner, sample, "hi", None) is None
    assert resume(runner, Sample(completion_token_ids=[1, 2]), "hi", None) is None  # no context, no mask


def test_an_ended_episode_is_carried_as_it_is(tiny):  # noqa: F811
    runner, e = episode_of(tiny, scripted.Counter)
    resumed = resume(runner, partial_sample(e, Turn()), "hi", None)
    assert resumed is not None and resumed.episode.env is None
    got = resumed.episode
    assert (got.token_ids, got.loss_mask, got.versions, got.turn_ends, got.turn_rewards) == (
        e.token_ids, e.loss_mask, e.versions, e.turn_ends, e.turn_rewards)
    assert (got.reward, got.end, got.finish) == (1.0, EpisodeEnd(EndKind.DONE), e.finish)


def test_an_ended_episode_whose_end_no_episode_has_starts_again(tiny):  # noqa: F811
    runner, e = episode_of(tiny, scripted.Counter)
    sample = partial_sample(e, Turn())
    sample.episode_end = "finished"  # not an end (a generator of another version, or a corrupt save)
    assert resume(runner, sample, "hi", None) is None

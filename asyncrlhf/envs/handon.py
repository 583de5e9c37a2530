"""A partial episode handed on from one generator to another, and continued there.

An environment's state cannot in general be serialised (a sandbox, a game, a server session), so what is
handed on is the episode's *transcript*: its first context, its tokens so far (the model's turns with their
log-probs and versions, the observations between them), the loss mask, where each ended turn stops
(`turn_ends`) and each step's reward (`turn_rewards`), in `PromptGroup.partial_samples`. The generator that
continues it makes a fresh environment and **replays** it: `reset(prompt)` and the recorded actions, one
`step` each, checking that it gets the same first context, the same rewards and the same observation ids.
Then the episode goes on from where it stopped: a turn cut mid-way continues from its tokens, a turn whose
step was pending has that step run now. If the replay disagrees (the environment is not deterministic, or
failed), the episode starts again from its prompt: its tokens are not trained on under a transcript the
environment would not produce. Replay runs every recorded step again, so a tool with side effects sees its
calls twice. An episode that had ended is carried as it is, without an environment.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from asyncrlhf._proto.rollout_pb2 import FinishReason, Sample
from asyncrlhf.envs.base import EnvFailure, EpisodeEnd
from asyncrlhf.envs.episode import Episode, EpisodeRunner
from asyncrlhf.sampling.backend import Finish
from asyncrlhf.sampling.rollouts import FINISH, FINISH_OF


@dataclass
class Turn:
    """A model turn in progress: its tokens so far, their log-probs and the version that sampled each."""

    token_ids: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    versions: list[int] = field(default_factory=list)


@dataclass
class Resumed:
    """An episode opened on this generator: `turn` is the turn in progress at the hand-on (continue it),
    `pending` the action of an ended turn whose step had not returned (step it now; the turn ended with
    `finish`); `restarted` when a handed-on episode could not be replayed and started again."""

    episode: Episode
    turn: Turn = field(default_factory=Turn)
    pending: str | None = None
    finish: Finish = "length"
    restarted: bool = False


def partial_sample(episode: Episode | None, turn: Turn) -> Sample:
    """The episode as a partial sample to hand on: its tokens and the turn in progress (an empty sample for
    an episode whose environment had not opened yet: it starts again)."""
    if episode is None:
        return Sample()
    ended = episode.end is not None
    out = Sample(completion_token_ids=episode.token_ids + ([] if ended else turn.token_ids),
                 logprobs=episode.logprobs + ([] if ended else turn.logprobs),
                 token_versions=episode.versions + ([] if ended else turn.versions),
                 loss_mask=episode.loss_mask + ([] if ended else [1] * len(turn.token_ids)),
                 turns=episode.turns, turn_ends=episode.turn_ends, turn_rewards=episode.turn_rewards,
                 episode_context_ids=episode.prompt_ids, continued_from=episode.continued_from,
                 finish_reason=FINISH[episode.finish] if ended else FinishReason.FINISH_REASON_UNSPECIFIED)
    if ended:
        out.env_reward, out.episode_end = episode.reward, str(episode.end)
    return out


def resume(runner: EpisodeRunner, sample: Sample, prompt: str, reference: str | None) -> Resumed | None:
    """The handed-on episode `sample` rebuilt here: carried as it is when it had ended, else replayed into a
    fresh environment. None when it cannot be (malformed, or the replay disagrees): start it again."""
    ids, mask = list(sample.completion_token_ids), list(sample.loss_mask)
    logps, versions = list(sample.logprobs), list(sample.token_versions)
    if not sample.episode_context_ids or not len(ids) == len(mask) == len(logps) == len(versions):
        return None
    if sample.finish_reason != FinishReason.FINISH_REASON_UNSPECIFIED:
        return _ended(sample, ids, mask, logps, versions)
    episode = runner.start(prompt, reference)
    if episode.end is not None or episode.prompt_ids != list(sample.episode_context_ids):
        return None
    ends, rewards = list(sample.turn_ends), list(sample.turn_rewards)
    pos = 0
    for i, end in enumerate(ends):
        if not pos < end <= len(ids) or not all(mask[pos:end]):
            return None
        episode.append(ids[pos:end], logps[pos:end], versions[pos:end], model=True)
        episode.turns += 1
        episode.turn_ends.append(end)
        action = runner.tokenizer.decode(ids[pos:end], skip_special_tokens=True)
        if i == len(rewards):  # the last turn's step had not returned: it runs now, for real
            if end != len(ids) or i != len(ends) - 1:
                return None
            episode.continued_from = len(ids)
            return Resumed(episode, pending=action,
                           finish="stop" if ids[-1] == runner.tokenizer.eos_token_id else "length")
        result = runner.step_env(episode, action)
        if isinstance(result, EnvFailure) or result.reward != rewards[i]:
            return None
        # a turn cut by length was closed by an EOS the model did not sample (masked)
        closed = end < len(ids) and mask[end] == 0 and ids[end] == runner.tokenizer.eos_token_id
        finish: Finish = "length" if closed else "stop"
        runner.after_step(episode, finish, result)
        pos = len(episode.token_ids)
        if episode.end is not None or episode.token_ids != ids[:pos]:
            return None
        episode.versions[end:pos] = versions[end:pos]  # as recorded (the ids are checked equal)
    if not all(mask[pos:]) or len(rewards) != len(ends):
        return None
    episode.continued_from = len(ids)
    return Resumed(episode, Turn(ids[pos:], logps[pos:], versions[pos:]))


def _ended(sample: Sample, ids: list[int], mask: list[int], logps: list[float],
           versions: list[int]) -> Resumed | None:
    """The ended episode `sample` carried as it is (None when its end is not one an episode has)."""
    try:
        end = EpisodeEnd.parse(sample.episode_end)
    except ValueError:
        return None
    return Resumed(Episode(
        env=None, prompt_ids=list(sample.episode_context_ids), token_ids=ids, logprobs=logps,
        versions=versions, loss_mask=mask, turns=sample.turns, turn_ends=list(sample.turn_ends),
        turn_rewards=list(sample.turn_rewards), reward=sample.env_reward, end=end,
        finish=FINISH_OF.get(sample.finish_reason, "length"), continued_from=sample.continued_from))

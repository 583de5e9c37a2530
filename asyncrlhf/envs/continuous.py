"""Episodes in a running engine (`generator.mode: continuous` with `task.env`): the `SampleKind` of the
continuous sampler (`asyncrlhf.sampling.continuous`) whose samples are multi-turn episodes. Each episode's
next model turn is added to the engine the moment its environment step returns, so no episode waits for the
slowest of a batch, and the engine keeps stepping the other sequences while a step is pending.

Each model turn is one engine sequence (`ContinuousSampler.add` with the episode's context so far, up to the
turn's room); its tokens arrive step by step, each recorded with the policy version of the engine step that
sampled it (a push may land between two turns or within one). When the turn ends it goes into the episode as
sampled (`EpisodeRunner.take`: no re-tokenisation) and the environment steps on its text on a pool thread
(bounded by `step_timeout_s`: a hung step ends its own episode only). Opening an episode (`reset`, or the
replay of a handed-on one: `asyncrlhf.envs.handon`) runs on the pool too; what returned goes on in `poll`, on
the sampler's thread, with everything else (the engine, the episodes' bookkeeping).

A group's k episodes are written together, the step its last episode ends. A group stopped is handed on with
`partial_sample`: the engine's partial turn is part of what goes.
"""

from __future__ import annotations

from collections.abc import Callable, Collection
from concurrent.futures import FIRST_COMPLETED, Future, ThreadPoolExecutor, wait
from dataclasses import dataclass, field
from typing import Any

from asyncrlhf._proto.rollout_pb2 import PromptGroup, RolloutGroup, Sample
from asyncrlhf.envs.base import EnvFailure, StepResult
from asyncrlhf.envs.episode import MAX_PARALLEL_STEPS, Episode, EpisodeRunner
from asyncrlhf.envs.handon import Resumed, Turn, partial_sample, resume
from asyncrlhf.envs.rollouts import episode_group
from asyncrlhf.sampling.backend import Completion, Finish
from asyncrlhf.sampling.continuous import ContinuousSampler, GroupRun, Tokens
from asyncrlhf.version import PolicyVersion


@dataclass
class Slot:
    """One episode of a group: `episode` once its environment opened, and the model `turn` in progress."""

    episode: Episode | None = None
    turn: Turn = field(default_factory=Turn)
    finish: Finish = "length"  # how the last ended turn ended (its step is pending or taken)
    handed: Sample | None = None  # the transcript it continues, until its replay is done

    def partial(self) -> Sample:
        """What to hand on: the episode's transcript, or while its replay runs, the one it continues."""
        if self.episode is None:
            return self.handed or Sample()
        return partial_sample(self.episode, self.turn)

    @property
    def token_ids(self) -> list[int]:
        return (self.episode.token_ids if self.episode else []) + self.turn.token_ids

    @property
    def ended(self) -> bool:
        return self.episode is not None and self.episode.end is not None


Sampler = ContinuousSampler[Any, Slot]
Run = GroupRun[Any, Slot]


def episodes_of(run: Run) -> list[Episode]:
    """The group's episodes that opened (all of them, once it ended)."""
    return [s.episode for s in run.samples if s.episode is not None]


class Episodes:
    """Multi-turn episodes (`SampleKind`): a sequence per model turn, the environment's steps on a pool."""

    def __init__(self, runner: EpisodeRunner):
        self.runner = runner
        self._waiting: dict[Future, tuple[str, int]] = {}  # environment calls in flight
        self._pool = ThreadPoolExecutor(MAX_PARALLEL_STEPS, thread_name_prefix="env")

    def fresh(self, partial: Sample | None) -> Slot:
        return Slot(handed=partial)

    def begin(self, sampler: Sampler, run: Run, j: int) -> None:
        """The episode's environment opened (reset, or a handed-on episode replayed) off this thread."""
        partial, prompt, reference = run.samples[j].handed, run.prompt.text, run.prompt.reference

        def opened() -> Resumed | None:
            if partial is not None and (partial.completion_token_ids or partial.finish_reason):
                resumed = resume(self.runner, partial, prompt, reference)
                if resumed is not None:
                    return resumed
                return Resumed(self.runner.start(prompt, reference), restarted=True)
            return Resumed(self.runner.start(prompt, reference))

        self._waiting[self._pool.submit(opened)] = (run.group_id, j)

    def sequence(self, sample: Slot) -> Tokens:
        return sample.turn

    def sequence_ended(self, sampler: Sampler, run: Run, j: int, finish: Finish) -> None:
        """The turn into the episode, and its action to the environment."""
        slot = run.samples[j]
        assert slot.episode is not None
        turn, slot.turn, slot.finish = slot.turn, Turn(), finish
        action = self.runner.take(slot.episode, Completion(turn.token_ids, turn.logprobs, finish,
                                                           tuple(turn.versions)))
        self._step_env(run, j, action)

    def poll(self, sampler: Sampler) -> None:
        """Environment calls that returned go on: their episodes' next turns into the engine."""
        for future in [f for f in self._waiting if f.done()]:
            if future in self._waiting:  # not dropped with its group since
                self._returned(sampler, future)

    def waiting(self) -> int:
        return len(self._waiting)  # an episode not ended is in the engine or waits on one call here

    def settle(self, timeout_s: float) -> None:
        if self._waiting:
            wait(list(self._waiting), timeout=timeout_s, return_when=FIRST_COMPLETED)

    def forget(self, group_ids: Collection[str]) -> None:
        self._waiting = {f: w for f, w in self._waiting.items() if w[0] not in group_ids}

    def partial(self, sample: Slot, decode: Callable[[list[int]], str]) -> Sample:
        return sample.partial()

    def rollout(self, prompt: PromptGroup, run: Run, version: PolicyVersion, generator_id: str,
                generated_at: float, decode: Callable[[list[int]], str]) -> RolloutGroup:
        return episode_group(prompt, episodes_of(run), version, generator_id, run.started_at, generated_at,
                             decode)

    def close(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)

    # -- an episode's life -------------------------------------------------------------------------------

    def _returned(self, sampler: Sampler, future: Future) -> None:
        gid, j = self._waiting.pop(future)
        run = sampler.group(gid)
        slot = run.samples[j]
        try:
            outcome = future.result()
        except Exception as err:  # not the environment's failure (that is a value): the group cannot go on
            sampler.fail(gid, f"{type(err).__name__}: {err}")
            return
        if isinstance(outcome, Resumed):
            slot.episode, slot.turn, slot.finish = outcome.episode, outcome.turn, outcome.finish
            slot.handed = None
            run.restarted += outcome.restarted
            if outcome.pending is not None:
                self._step_env(run, j, outcome.pending)
            elif not slot.ended:
                self._next_turn(sampler, run, j)
            return
        assert slot.episode is not None
        self.runner.after_step(slot.episode, slot.finish, outcome)
        if not slot.ended:
            self._next_turn(sampler, run, j)

    def _next_turn(self, sampler: Sampler, run: Run, j: int) -> None:
        """The episode's next model turn into the engine (or the rest of a turn handed on mid-way)."""
        slot = run.samples[j]
        assert slot.episode is not None
        room = self.runner.room(slot.episode) - len(slot.turn.token_ids)
        if room <= 0:  # a turn handed on at its last token: it ended by length
            self.sequence_ended(sampler, run, j, "length")
            return
        sampler.add(run, j, slot.episode.prompt_ids + slot.token_ids, room)

    def _step_env(self, run: Run, j: int, action: str) -> None:
        episode = run.samples[j].episode
        assert episode is not None

        def stepped() -> StepResult | EnvFailure:
            return self.runner.step_env(episode, action)

        self._waiting[self._pool.submit(stepped)] = (run.group_id, j)

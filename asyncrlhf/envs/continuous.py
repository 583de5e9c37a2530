"""Episodes in a running engine (`generator.mode: continuous` with `task.env`): each episode's next model
turn is added to the engine the moment its environment step returns, so no episode waits for the slowest
of a batch, and the engine keeps stepping the other sequences while a step is pending.

Each model turn is one engine sequence (`StepEngine.add` with the episode's context so far, up to the
turn's room); its tokens arrive step by step, each recorded with the policy version of the engine step
that sampled it (a push may land between two turns or within one). When the turn ends it goes into the
episode as sampled (`EpisodeRunner.take`: no re-tokenisation) and the environment steps on its text on a
pool thread (bounded by `step_timeout_s`: a hung step ends its own episode only). Opening an episode
(`reset`, or the replay of a handed-on one: `asyncrlhf.envs.handon`) runs on the pool too. Everything else
(the engine, the episodes' bookkeeping) happens on the caller's thread, in `step`.

A group's k episodes are written together, the step its last episode ends (`step` returns it). `stop_all`
aborts them all, to be handed on with `partial_sample`: the engine's partial turn is part of what goes.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from concurrent.futures import FIRST_COMPLETED, Future, ThreadPoolExecutor, wait
from dataclasses import dataclass, field
from typing import Generic, TypeVar

from asyncrlhf._proto.rollout_pb2 import Sample
from asyncrlhf.config import SamplingConfig
from asyncrlhf.envs.base import EnvFailure, StepResult
from asyncrlhf.envs.episode import MAX_PARALLEL_STEPS, Episode, EpisodeRunner
from asyncrlhf.envs.handon import Resumed, Turn, partial_sample, resume
from asyncrlhf.sampling.backend import Completion, Finish
from asyncrlhf.sampling.continuous import StepEngine, with_engine_versions

T = TypeVar("T")


@dataclass
class Slot:
    """One episode of a group: `episode` once its environment opened, the model `turn` in progress, and
    where it waits: on the engine (`key`) or on the environment (`future`)."""

    episode: Episode | None = None
    turn: Turn = field(default_factory=Turn)
    key: str | None = None
    future: Future | None = None
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
        return self.episode is not None and bool(self.episode.end)


@dataclass
class EpisodeRun(Generic[T]):
    """One prompt group's k episodes: `tag` is the caller's (its delivery), `lineage` the weights' lineage
    their tokens come from."""

    tag: T
    group_id: str
    prompt: str
    reference: str | None
    samples: list[Slot]
    lineage: int
    started_at: float = field(default_factory=time.time)
    saved_tokens: int = 0
    restarted: int = 0  # handed-on episodes that could not be replayed here and started again

    @property
    def done(self) -> bool:
        return all(s.ended for s in self.samples)

    @property
    def tokens(self) -> int:
        return sum(len(s.token_ids) for s in self.samples)

    @property
    def episodes(self) -> list[Episode]:
        return [s.episode for s in self.samples if s.episode is not None]


class ContinuousEpisodes(Generic[T]):
    """The episode groups in a `StepEngine`, started when the caller has slots, returned the step their
    last episode ends."""

    def __init__(self, engine: StepEngine, runner: EpisodeRunner, sampling: SamplingConfig):
        self.engine, self.runner, self.sampling = engine, runner, sampling
        self._groups: dict[str, EpisodeRun[T]] = {}
        self._sequences: dict[str, tuple[str, int]] = {}  # engine key -> (group id, episode index)
        self._waiting: dict[Future, tuple[str, int]] = {}  # environment calls in flight
        self._pool = ThreadPoolExecutor(MAX_PARALLEL_STEPS, thread_name_prefix="env")
        self._seq = 0
        self._failed: list[tuple[EpisodeRun[T], str]] = []
        self.sampled_tokens = 0  # model tokens the engine sampled for these episodes, all steps

    @property
    def running_samples(self) -> int:
        """Episodes in flight (in the engine or waiting on their environment)."""
        return sum(not s.ended for run in self._groups.values() for s in run.samples)

    @property
    def in_engine(self) -> int:
        return len(self._sequences)

    @property
    def groups(self) -> list[EpisodeRun[T]]:
        return list(self._groups.values())

    def start(self, tag: T, group_id: str, prompt: str, reference: str | None, k: int, *, lineage: int,
              partial: Sequence[Sample] = ()) -> EpisodeRun[T]:
        """Start (or continue, from `partial`: at most k handed-on episodes) the k episodes of a group."""
        if group_id in self._groups:
            raise ValueError(f"group {group_id!r} is already being sampled")
        run: EpisodeRun[T] = EpisodeRun(tag, group_id, prompt, reference, [Slot() for _ in range(k)], lineage)
        self._groups[group_id] = run
        for j in range(k):
            self._open(run, j, partial[j] if j < len(partial) else None)
        run.saved_tokens = sum(len(p.completion_token_ids) for p in partial[:k])
        return run

    def settle(self, timeout_s: float) -> None:
        """With no turn in the engine, wait (at most `timeout_s`) for an environment call to return: bounded,
        so a push (run by the caller between two steps) is not kept waiting on an environment."""
        if not self._sequences and self._waiting:
            wait(list(self._waiting), timeout=timeout_s, return_when=FIRST_COMPLETED)

    def step(self, version: int) -> list[EpisodeRun[T]]:
        """Environment calls that returned go on (their next turns into the engine); one engine step, its
        tokens recorded as sampled by `version`; the groups whose last episode ended."""
        for future in [f for f in self._waiting if f.done()]:
            if future in self._waiting:  # not dropped with its group since
                self._returned(future)
        for delta in self.engine.step():
            where = self._sequences.get(delta.key)
            if where is None:  # another client's sequence (the API's), or one aborted since
                continue
            slot = self._groups[where[0]].samples[where[1]]
            slot.turn.token_ids += delta.token_ids
            slot.turn.logprobs += delta.logprobs
            slot.turn.versions += [version] * len(delta.token_ids)
            self.sampled_tokens += len(delta.token_ids)
            if delta.finish is not None:
                with_engine_versions(slot.turn.versions, delta)
                del self._sequences[delta.key]
                slot.key = None
                self._turn_ended(where[0], where[1], delta.finish)
        return self.finished_now()

    def take_failed(self) -> list[tuple[EpisodeRun[T], str]]:
        """Groups dropped since the last call because opening or stepping an episode raised something other
        than an environment's failure (which ends only its episode): with why, for the caller to retry."""
        failed, self._failed = self._failed, []
        return failed

    def finished_now(self) -> list[EpisodeRun[T]]:
        done = [run for run in self._groups.values() if run.done]
        for run in done:
            del self._groups[run.group_id]
        return done

    def stop_all(self) -> list[EpisodeRun[T]]:
        """Abort every group in flight (turns in the engine; environment calls are left to finish unread);
        their episodes, to be handed on."""
        self.engine.abort(list(self._sequences))
        self._sequences.clear()
        self._waiting.clear()
        runs, self._groups = list(self._groups.values()), {}
        return runs

    def restart(self, group_ids: Sequence[str], lineage: int) -> None:
        """Start these groups' unfinished episodes again under `lineage` (weights of another learner lineage
        arrived: tokens of two lineages never share a sample)."""
        for gid in group_ids:
            run = self._groups[gid]
            self._forget(gid)
            run.samples = [Slot() for _ in run.samples]
            run.lineage, run.saved_tokens = lineage, 0
            for j in range(len(run.samples)):
                self._open(run, j, None)

    def close(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)

    # -- an episode's life -------------------------------------------------------------------------------

    def _open(self, run: EpisodeRun[T], j: int, partial: Sample | None) -> None:
        """The episode's environment opened (reset, or a handed-on episode replayed) off this thread."""
        def opened() -> Resumed | None:
            if partial is not None and (partial.completion_token_ids or partial.finish_reason):
                resumed = resume(self.runner, partial, run.prompt, run.reference)
                if resumed is not None:
                    return resumed
                return Resumed(self.runner.start(run.prompt, run.reference), restarted=True)
            return Resumed(self.runner.start(run.prompt, run.reference))

        run.samples[j].handed = partial
        self._wait_on(run, j, self._pool.submit(opened))

    def _wait_on(self, run: EpisodeRun[T], j: int, future: Future) -> None:
        run.samples[j].future = future
        self._waiting[future] = (run.group_id, j)

    def _returned(self, future: Future) -> None:
        gid, j = self._waiting.pop(future)
        slot = self._groups[gid].samples[j]
        slot.future = None
        try:
            outcome = future.result()
        except Exception as err:  # not the environment's failure (that is a value): the group cannot go on
            self._fail(gid, f"{type(err).__name__}: {err}")
            return
        if isinstance(outcome, Resumed):
            slot.episode, slot.turn, slot.finish = outcome.episode, outcome.turn, outcome.finish
            slot.handed = None
            run = self._groups[gid]
            run.restarted += outcome.restarted
            if outcome.pending is not None:
                self._step_env(gid, j, outcome.pending)
            elif not slot.ended:
                self._next_turn(gid, j)
            return
        assert slot.episode is not None
        self.runner.after_step(slot.episode, slot.finish, outcome)
        if not slot.ended:
            self._next_turn(gid, j)

    def _fail(self, gid: str, reason: str) -> None:
        self._forget(gid)
        self._failed.append((self._groups.pop(gid), reason))

    def _forget(self, gid: str) -> None:
        """Abort the group's turns in the engine and stop waiting for its environment calls."""
        self.engine.abort([key for key, (g, _) in self._sequences.items() if g == gid])
        self._sequences = {key: w for key, w in self._sequences.items() if w[0] != gid}
        self._waiting = {f: w for f, w in self._waiting.items() if w[0] != gid}

    def _next_turn(self, gid: str, j: int) -> None:
        """The episode's next model turn into the engine (or the rest of a turn handed on mid-way)."""
        slot = self._groups[gid].samples[j]
        assert slot.episode is not None
        room = self.runner.room(slot.episode) - len(slot.turn.token_ids)
        if room <= 0:  # a turn handed on at its last token: it ended by length
            self._turn_ended(gid, j, "length")
            return
        self._seq += 1
        slot.key = f"{gid}/{j}#{self._seq}"
        self._sequences[slot.key] = (gid, j)
        self.engine.add(slot.key, slot.episode.prompt_ids + slot.token_ids, room, self.sampling)

    def _turn_ended(self, gid: str, j: int, finish: Finish) -> None:
        slot = self._groups[gid].samples[j]
        assert slot.episode is not None
        turn, slot.turn, slot.finish = slot.turn, Turn(), finish
        action = self.runner.take(slot.episode, Completion(turn.token_ids, turn.logprobs, finish,
                                                           tuple(turn.versions)))
        self._step_env(gid, j, action)

    def _step_env(self, gid: str, j: int, action: str) -> None:
        episode = self._groups[gid].samples[j].episode
        assert episode is not None

        def stepped() -> StepResult | EnvFailure:
            return self.runner.step_env(episode, action)

        self._wait_on(self._groups[gid], j, self._pool.submit(stepped))

"""Continuous generation: groups enter and leave a running engine one engine step at a time, single-turn
samples and episodes alike.

A `StepEngine` (vLLM's engine driven step by step: `asyncrlhf.sampling.vllm_stepping`) runs sequences; the
`ContinuousSampler` keeps the groups they belong to. What one of a group's k samples is, is a `SampleKind`: a
single-turn sample is one sequence (`asyncrlhf.sampling.single_turn.Completions`), an episode one sequence
per model turn with its environment's steps between them (`asyncrlhf.envs.continuous.Episodes`). Everything
else is kept here once: which sequence is which group's which sample, the tokens each step sampled, a group's
end, its stop and its restart. So a group can start whenever k slots are free and ends the step its last
sample ends, whatever the others in the engine are doing. Weights may change between two steps: each step's
tokens record the policy version that sampled them (the caller passes it to `step`: the thread that steps is
the one that applies pushes, between two steps, so it knows the version of each), so a sample carries one
version per token.

A sample in flight can leave with its progress (`stop_all`, `SampleKind.partial`): its tokens so far and
their log-probs and versions (an episode: its transcript). Another generator continues it from there
(`start` with `partial`): the earlier tokens are kept as they are, and the engine samples the rest with the
tokens so far as prompt.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Collection, Sequence
from dataclasses import dataclass, field
from typing import Any, Generic, Protocol, TypeVar

from asyncrlhf._proto.rollout_pb2 import PromptGroup, RolloutGroup, Sample
from asyncrlhf.config import SamplingConfig
from asyncrlhf.sampling.backend import Finish
from asyncrlhf.version import PolicyVersion

T = TypeVar("T")


@dataclass(frozen=True)
class StepDelta:
    """What one engine step sampled for one sequence: its new tokens and their log-probs, and `finish` once
    the sequence ended. `versions`, once it ended, where the engine reports it: the version of the weights
    that sampled each of the sequence's tokens, by the engine's own account (None for a token sampled before
    any version was labelled); it replaces the loop's labels (`with_engine_versions`)."""

    key: str
    token_ids: list[int]
    logprobs: list[float]
    finish: Finish | None = None
    versions: tuple[int | None, ...] | None = None


def with_engine_versions(labels: list[int], delta: StepDelta) -> None:
    """Replace the loop's labels of an ended sequence's tokens (the last `len(delta.versions)` of `labels`:
    a sequence continues a sample or an episode's earlier tokens) by the engine's own, where it gives one.
    The loop labels a step's tokens with the version it holds when it reads them; an engine that steps in a
    process of its own may have sampled them before the push the loop already applied."""
    if delta.versions is None or len(delta.versions) > len(labels):
        return  # no account, or not of these tokens: the loop's labels stand
    start = len(labels) - len(delta.versions)
    labels[start:] = [ours if engine is None else engine
                      for ours, engine in zip(labels[start:], delta.versions, strict=True)]


class StepEngine(Protocol):
    """An engine that runs many sequences and advances them all by one step at a time."""

    def add(self, key: str, prompt_ids: Sequence[int], max_tokens: int, sampling: SamplingConfig) -> None:
        """Start sampling up to `max_tokens` tokens after `prompt_ids` as sequence `key`."""

    def step(self) -> list[StepDelta]:
        """Advance every running sequence by one step; what each produced."""

    def abort(self, keys: Sequence[str]) -> None:
        """Stop these sequences (their tokens so far are the caller's to keep)."""

    def running(self) -> int:
        """Sequences started and not ended (the loop's own and any other client's)."""

    def pending(self) -> bool:
        """Whether another client's request waits to be added at the next step."""

    def serve_calls(self, timeout_s: float = 0.0) -> int:
        """Run the work other threads queued for the engine (a weight push), between two steps: the thread
        that steps is the only one that talks to the engine. Waits up to `timeout_s` for some when none is
        queued; returns how many ran."""

    def fail_waiting(self, reason: str) -> None:
        """Fail every other client's request and queued work not answered yet (the loop stops stepping)."""


class Tokens(Protocol):
    """Where a running sequence's tokens go: the sample's tokens (single-turn) or its turn's (an episode)."""

    token_ids: list[int]
    logprobs: list[float]
    versions: list[int]


class SampleState(Protocol):
    """One of a group's samples, as the sampler sees it: its tokens so far and whether it ended."""

    @property
    def token_ids(self) -> list[int]: ...

    @property
    def ended(self) -> bool: ...


S = TypeVar("S", bound=SampleState)


@dataclass
class GroupPrompt:
    """What a group's samples start from: the prompt's ids (a single-turn sample continues them), and its
    text and reference (an episode's environment is reset on them)."""

    ids: list[int] = field(default_factory=list)
    text: str = ""
    reference: str | None = None


@dataclass
class GroupRun(Generic[T, S]):
    """One prompt group in the engine: `tag` is the caller's (its delivery), `lineage` the weights' lineage
    its tokens come from."""

    tag: T
    group_id: str
    prompt: GroupPrompt
    samples: list[S]
    lineage: int
    started_at: float = field(default_factory=time.time)
    saved_tokens: int = 0  # tokens of this group when its progress was last saved
    restarted: int = 0  # handed-on samples that could not be continued here and started again

    @property
    def done(self) -> bool:
        return all(s.ended for s in self.samples)

    @property
    def tokens(self) -> int:
        return sum(len(s.token_ids) for s in self.samples)


class SampleKind(Protocol[S]):
    """What one of a group's samples is: how it starts and what its sequences' ends do (the sampler adds its
    sequences and steps them), what it waits on off the engine's thread, and how it leaves: as part of a
    rollout, or as progress another generator continues."""

    def fresh(self, partial: Sample | None) -> S:
        """A sample to run: a new one, or one that continues `partial` (handed on by another generator)."""

    def begin(self, sampler: ContinuousSampler[Any, S], run: GroupRun[Any, S], j: int) -> None:
        """Set `run`'s sample j going (`sampler.add` its first sequence), just started or started again."""

    def sequence(self, sample: S) -> Tokens:
        """Where the tokens of `sample`'s running sequence go."""

    def sequence_ended(self, sampler: ContinuousSampler[Any, S], run: GroupRun[Any, S], j: int,
                       finish: Finish) -> None:
        """`run`'s sample j's sequence ended with `finish` (its tokens are in `sequence`)."""

    def poll(self, sampler: ContinuousSampler[Any, S]) -> None:
        """Before an engine step: work that returned from off the engine's thread goes on."""

    def waiting(self) -> int:
        """Samples waiting on work off the engine's thread (each running sample is in the engine or waits)."""

    def settle(self, timeout_s: float) -> None:
        """Wait up to `timeout_s` for work off the engine's thread to return (none in the engine)."""

    def forget(self, group_ids: Collection[str]) -> None:
        """Stop waiting on work off the engine's thread for these groups (stopped or dropped)."""

    def partial(self, sample: S, decode: Callable[[list[int]], str]) -> Sample:
        """`sample`'s progress, to hand on."""

    def rollout(self, prompt: PromptGroup, run: GroupRun[Any, S], version: PolicyVersion, generator_id: str,
                generated_at: float, decode: Callable[[list[int]], str]) -> RolloutGroup:
        """The ended group as the rollouts stream carries it (`version`: the lineage and the step served)."""

    def close(self) -> None:
        """Release what runs off the engine's thread."""


class ContinuousSampler(Generic[T, S]):
    """The groups in a `StepEngine`, started when the caller has slots, returned the step they end; their
    samples are `kind`'s."""

    def __init__(self, engine: StepEngine, kind: SampleKind[S], sampling: SamplingConfig):
        self.engine, self.kind, self.sampling = engine, kind, sampling
        self._groups: dict[str, GroupRun[T, S]] = {}
        self._sequences: dict[str, tuple[str, int]] = {}  # sequence key -> (group id, sample index)
        self._failed: list[tuple[GroupRun[T, S], str]] = []
        self._seq = 0
        self.sampled_tokens = 0  # tokens the engine sampled for this sampler's groups, all steps

    @property
    def running_samples(self) -> int:
        """Samples started and not ended: in the engine, or waiting off it (an episode's environment)."""
        return len(self._sequences) + self.kind.waiting()

    @property
    def groups(self) -> list[GroupRun[T, S]]:
        return list(self._groups.values())

    def group(self, group_id: str) -> GroupRun[T, S]:
        return self._groups[group_id]

    def start(self, tag: T, group_id: str, prompt: GroupPrompt, k: int, *, lineage: int,
              partial: Sequence[Sample] = ()) -> GroupRun[T, S]:
        """Start (or continue, from `partial`: at most k handed-on samples) the k samples of a group; returns
        it (ended already when every partial sample had)."""
        if group_id in self._groups:
            raise ValueError(f"group {group_id!r} is already being sampled")
        carried = list(partial[:k])
        samples = [self.kind.fresh(carried[j] if j < len(carried) else None) for j in range(k)]
        run: GroupRun[T, S] = GroupRun(tag, group_id, prompt, samples, lineage,
                                       saved_tokens=sum(len(p.completion_token_ids) for p in carried))
        self._groups[group_id] = run
        for j in range(k):
            self.kind.begin(self, run, j)
        return run

    def add(self, run: GroupRun[T, S], j: int, context: Sequence[int], max_tokens: int) -> None:
        """`run`'s sample j samples up to `max_tokens` tokens after `context`, as one engine sequence."""
        self._seq += 1
        key = f"{run.group_id}/{j}#{self._seq}"
        self._sequences[key] = (run.group_id, j)
        self.engine.add(key, context, max_tokens, self.sampling)

    def settle(self, timeout_s: float) -> None:
        """With no sequence in the engine, wait (at most `timeout_s`) for work off it to return: bounded, so
        a push (run by the caller between two steps) is not kept waiting on an environment."""
        if not self._sequences:
            self.kind.settle(timeout_s)

    def step(self, version: int) -> list[GroupRun[T, S]]:
        """Work returned from off the engine goes on; one engine step, its tokens recorded as sampled by
        `version`; the groups that ended (in the step, then any other)."""
        self.kind.poll(self)
        ended: list[GroupRun[T, S]] = []
        for delta in self.engine.step():
            where = self._sequences.get(delta.key)
            if where is None:  # another client's sequence (the API's), or one aborted since
                continue
            run = self._groups[where[0]]
            tokens = self.kind.sequence(run.samples[where[1]])
            tokens.token_ids += delta.token_ids
            tokens.logprobs += delta.logprobs
            tokens.versions += [version] * len(delta.token_ids)
            self.sampled_tokens += len(delta.token_ids)
            if delta.finish is not None:
                with_engine_versions(tokens.versions, delta)
                del self._sequences[delta.key]
                self.kind.sequence_ended(self, run, where[1], delta.finish)
                if run.done:
                    ended.append(self._groups.pop(run.group_id))
        return ended + self.finished_now()

    def finished_now(self) -> list[GroupRun[T, S]]:
        """Groups that ended without an engine step (every sample handed on had already ended)."""
        done = [run for run in self._groups.values() if run.done]
        for run in done:
            del self._groups[run.group_id]
        return done

    def fail(self, group_id: str, reason: str) -> None:
        """Drop a group that cannot go on (its kind says why), for the caller to retry (`take_failed`)."""
        self._forget(group_id)
        self._failed.append((self._groups.pop(group_id), reason))

    def take_failed(self) -> list[tuple[GroupRun[T, S], str]]:
        """Groups dropped since the last call (`fail`), with why."""
        failed, self._failed = self._failed, []
        return failed

    def stop_all(self) -> list[GroupRun[T, S]]:
        """Abort every group in flight (work off the engine is left to finish unread); their progress, to be
        handed on."""
        self.engine.abort(list(self._sequences))
        self._sequences.clear()
        runs, self._groups = list(self._groups.values()), {}
        self.kind.forget([run.group_id for run in runs])
        return runs

    def restart(self, group_ids: Sequence[str], lineage: int) -> None:
        """Drop these groups' unfinished progress and sample it again under `lineage` (weights of another
        learner lineage arrived: tokens of two lineages never share a sample)."""
        for gid in group_ids:
            run = self._groups[gid]
            self._forget(gid)
            run.samples = [self.kind.fresh(None) for _ in run.samples]
            run.lineage, run.saved_tokens = lineage, 0
            for j in range(len(run.samples)):
                self.kind.begin(self, run, j)

    def close(self) -> None:
        self.kind.close()

    def _forget(self, gid: str) -> None:
        """Abort the group's sequences in the engine and stop waiting on its work off it."""
        keys = [key for key, (g, _) in self._sequences.items() if g == gid]
        self.engine.abort(keys)
        for key in keys:
            del self._sequences[key]
        self.kind.forget([gid])

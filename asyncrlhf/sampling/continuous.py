"""Continuous generation: samples enter and leave a running engine one engine step at a time.

A `StepEngine` (vLLM's engine driven step by step: `asyncrlhf.sampling.vllm_stepping`) runs sequences; the
`ContinuousSampler` keeps the groups they belong to. Each of a group's k samples is one sequence, so a group
can start whenever k slots are free and ends the step its last sample ends, whatever the others in the
engine are doing. Weights may change between two steps: each step's tokens record the policy version that
sampled them (the caller passes it to `step`: the thread that steps is the one that applies pushes, between
two steps, so it knows the version of each), so a sample carries one version per token.

A sample in flight can leave with its progress (`stop_all`, `progress`): its prompt, its tokens so far and
their log-probs and versions. Another generator continues it from there (`start` with `partial`): the
earlier tokens are kept as they are, and the engine samples the rest with the tokens so far as prompt.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Generic, Protocol, TypeVar

from asyncrlhf.config import SamplingConfig
from asyncrlhf.sampling.backend import Completion, Finish

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


@dataclass
class Progress:
    """One sample: its tokens so far, their log-probs and the version that sampled each; `finish` once it
    ended. `continued_from`: tokens sampled by an earlier generator before it handed the sample on."""

    token_ids: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    versions: list[int] = field(default_factory=list)
    finish: Finish | None = None
    continued_from: int = 0

    def completion(self) -> Completion:
        assert self.finish is not None, "only an ended sample is a completion"
        return Completion(list(self.token_ids), list(self.logprobs), self.finish, tuple(self.versions),
                          self.continued_from)


@dataclass
class GroupRun(Generic[T]):
    """One prompt group in the engine: `tag` is the caller's (its delivery), `lineage` the weights' lineage
    its tokens come from."""

    tag: T
    group_id: str
    prompt_ids: list[int]
    samples: list[Progress]
    lineage: int
    started_at: float = field(default_factory=time.time)
    saved_tokens: int = 0  # tokens of this group when its progress was last saved

    @property
    def done(self) -> bool:
        return all(s.finish is not None for s in self.samples)

    @property
    def tokens(self) -> int:
        return sum(len(s.token_ids) for s in self.samples)


class ContinuousSampler(Generic[T]):
    """The groups in a `StepEngine`, started when the caller has slots, returned the step they end."""

    def __init__(self, engine: StepEngine, sampling: SamplingConfig):
        self.engine, self.sampling = engine, sampling
        self._groups: dict[str, GroupRun[T]] = {}
        self._sequences: dict[str, tuple[str, int]] = {}  # sequence key -> (group id, sample index)
        self._seq = 0
        self.sampled_tokens = 0  # tokens the engine sampled for this sampler's groups, all steps

    @property
    def running_samples(self) -> int:
        return len(self._sequences)

    @property
    def groups(self) -> list[GroupRun[T]]:
        return list(self._groups.values())

    def start(self, tag: T, group_id: str, prompt_ids: Sequence[int], k: int, *,
              lineage: int, partial: Sequence[Progress] = ()) -> GroupRun[T]:
        """Start (or continue, from `partial`: at most k samples' progress) the k samples of a group; returns
        it (ended already when every partial sample had)."""
        if group_id in self._groups:
            raise ValueError(f"group {group_id!r} is already being sampled")
        samples = [Progress(list(p.token_ids), list(p.logprobs), list(p.versions), p.finish,
                            len(p.token_ids) if p.finish is None else p.continued_from) for p in partial[:k]]
        samples += [Progress() for _ in range(k - len(samples))]
        run = GroupRun(tag, group_id, list(prompt_ids), samples, lineage)
        run.saved_tokens = run.tokens
        self._groups[group_id] = run
        for j, sample in enumerate(samples):
            if sample.finish is None:
                self._add(run, j)
        return run

    def step(self, version: int) -> list[GroupRun[T]]:
        """One engine step, its tokens recorded as sampled by `version`; the groups that ended in it."""
        ended: list[GroupRun[T]] = []
        for delta in self.engine.step():
            where = self._sequences.get(delta.key)
            if where is None:  # another client's sequence (the API's), or one aborted since
                continue
            run = self._groups[where[0]]
            sample = run.samples[where[1]]
            sample.token_ids += delta.token_ids
            sample.logprobs += delta.logprobs
            sample.versions += [version] * len(delta.token_ids)
            self.sampled_tokens += len(delta.token_ids)
            if delta.finish is not None:
                with_engine_versions(sample.versions, delta)
                sample.finish = delta.finish
                del self._sequences[delta.key]
                if run.done:
                    ended.append(self._groups.pop(run.group_id))
        return ended

    def finished_now(self) -> list[GroupRun[T]]:
        """Groups that ended without a step (every sample handed on had already ended)."""
        done = [run for run in self._groups.values() if run.done]
        for run in done:
            del self._groups[run.group_id]
        return done

    def stop_all(self) -> list[GroupRun[T]]:
        """Abort every group in flight; their progress, to be handed on."""
        self.engine.abort(list(self._sequences))
        self._sequences.clear()
        runs, self._groups = list(self._groups.values()), {}
        return runs

    def restart(self, group_ids: Sequence[str], lineage: int) -> None:
        """Drop these groups' unfinished progress and sample it again under `lineage` (weights of another
        learner lineage arrived: tokens of two lineages never share a sample)."""
        for gid in group_ids:
            run = self._groups[gid]
            keys = [key for key, (g, _) in self._sequences.items() if g == gid]
            self.engine.abort(keys)
            for key in keys:
                del self._sequences[key]
            run.samples = [Progress() for _ in run.samples]
            run.lineage, run.saved_tokens = lineage, 0
            for j in range(len(run.samples)):
                self._add(run, j)

    def _add(self, run: GroupRun[T], j: int) -> None:
        sample = run.samples[j]
        left = self.sampling.max_new_tokens - len(sample.token_ids)
        if left <= 0:  # handed on at its last token: it ended by length
            sample.finish = "length"
            return
        self._seq += 1
        key = f"{run.group_id}/{j}#{self._seq}"
        self._sequences[key] = (run.group_id, j)
        self.engine.add(key, run.prompt_ids + sample.token_ids, left, self.sampling)

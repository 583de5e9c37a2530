"""The engine's own account of which weights sampled each token replaces the loop's labels when a sequence
ends: an engine stepping in a process of its own can sample a step's tokens before a push that the loop has
already applied when it reads them."""

from __future__ import annotations

from dataclasses import dataclass

import pytest

from asyncrlhf._proto.rollout_pb2 import Sample
from asyncrlhf.config import SamplingConfig
from asyncrlhf.sampling.continuous import ContinuousSampler, GroupPrompt, StepDelta, with_engine_versions
from asyncrlhf.sampling.single_turn import Completions, Progress
from asyncrlhf.sampling.vllm_stepping import engine_versions

pytestmark = pytest.mark.unit


@dataclass
class Span:  # the fields of vLLM's WeightVersionSpan
    version: str
    start: int
    end: int


def test_spans_give_each_token_its_version_and_none_where_no_version_was_labelled():
    assert engine_versions([Span("default", 0, 2), Span("3", 2, 3), Span("4", 3, 6)]) == (
        None, None, 3, 4, 4, 4)
    assert engine_versions(None) is None and engine_versions([]) is None


def test_the_engine_versions_replace_the_loops_labels_of_the_sequences_own_tokens_only():
    labels = [1, 1, 2, 2, 2]  # two tokens an earlier generator sampled, then this sequence's three
    with_engine_versions(labels, StepDelta("k", [9], [-0.1], "stop", (1, None, 2)))
    assert labels == [1, 1, 1, 2, 2]  # the engine's label where it gave one, the loop's where it did not


@pytest.mark.parametrize("versions", [None, (1, 1, 1, 1)], ids=["no account", "more tokens than labels"])
def test_without_an_account_of_these_tokens_the_loops_labels_stand(versions):
    labels = [2, 2, 2]
    with_engine_versions(labels, StepDelta("k", [9], [-0.1], "stop", versions))
    assert labels == [2, 2, 2]


class ScriptedEngine:
    """A StepEngine of scripted steps: the last one ends every sequence, with the engine's versions."""

    def __init__(self, steps: list[list[tuple[int, tuple[int, ...] | None]]]):
        self.steps, self.keys = steps, []

    def add(self, key, prompt_ids, max_tokens, sampling) -> None:
        self.keys.append(key)

    def step(self) -> list[StepDelta]:
        script = self.steps.pop(0)
        return [StepDelta(key, [token], [-0.5], "length" if versions else None, versions)
                for key, (token, versions) in zip(self.keys, script, strict=True)]

    def abort(self, keys) -> None: ...
    def running(self) -> int: return len(self.keys)
    def pending(self) -> bool: return False
    def fail_waiting(self, reason: str) -> None: ...


def test_a_sample_ends_with_the_versions_the_engine_reports_not_those_the_loop_held_when_it_read_them():
    # the loop reads the second token after applying push 2, but the engine sampled it under version 1
    engine = ScriptedEngine([[(5, None)], [(6, None)], [(7, (1, 1, 2))]])
    sampler: ContinuousSampler[str, Progress] = ContinuousSampler(engine, Completions(),
                                                                  SamplingConfig(max_new_tokens=3))
    run = sampler.start("t", "g", GroupPrompt([1, 2]), 1, lineage=1)
    sampler.step(1)
    sampler.step(2)
    (ended,) = sampler.step(2)
    assert ended is run and run.samples[0].versions == [1, 1, 2]
    assert run.samples[0].completion().versions == (1, 1, 2)


def test_a_continued_samples_earlier_tokens_keep_their_versions():
    engine = ScriptedEngine([[(7, (3,))]])
    sampler: ContinuousSampler[str, Progress] = ContinuousSampler(engine, Completions(),
                                                                  SamplingConfig(max_new_tokens=3))
    partial = Sample(completion_token_ids=[5, 6], logprobs=[-0.1, -0.2], token_versions=[1, 2])
    run = sampler.start("t", "g", GroupPrompt([1, 2]), 1, lineage=1, partial=[partial])
    sampler.step(4)
    assert run.samples[0].versions == [1, 2, 3]

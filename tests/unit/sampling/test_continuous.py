"""The continuous sampler's bookkeeping of single-turn samples on a scripted engine: a handed-on group goes on
from each sample's own progress (a malformed one alone is sampled again), and weights of another lineage
start a group's samples again from its prompt. (The same bookkeeping runs episodes: the vLLM tests of
`tests/integration/vllm/test_continuous_episodes.py`.)"""

from __future__ import annotations

import pytest

from asyncrlhf._proto.rollout_pb2 import Sample
from asyncrlhf.config import SamplingConfig
from asyncrlhf.sampling.continuous import ContinuousSampler, GroupPrompt, StepDelta
from asyncrlhf.sampling.single_turn import Completions, Progress

pytestmark = pytest.mark.unit

TOKEN = 7  # what the scripted engine samples, every step


class Engine:
    """A StepEngine that samples `TOKEN` for every running sequence each step until its `max_tokens`, and
    records what each sequence was asked to continue."""

    def __init__(self) -> None:
        self.contexts: dict[str, list[int]] = {}
        self.left: dict[str, int] = {}

    def add(self, key, prompt_ids, max_tokens, sampling) -> None:
        self.contexts[key], self.left[key] = list(prompt_ids), max_tokens

    def step(self) -> list[StepDelta]:
        out = []
        for key in list(self.left):
            self.left[key] -= 1
            out.append(StepDelta(key, [TOKEN], [-0.5], None if self.left[key] else "length"))
            if not self.left[key]:
                del self.left[key]
        return out

    def abort(self, keys) -> None:
        for key in keys:
            self.left.pop(key, None)

    def running(self) -> int:
        return len(self.left)

    def pending(self) -> bool:
        return False

    def serve_calls(self, timeout_s: float = 0.0) -> int:
        return 0

    def fail_waiting(self, reason: str) -> None: ...


def sampler(engine: Engine, max_new_tokens: int = 4) -> ContinuousSampler[str, Progress]:
    return ContinuousSampler(engine, Completions(), SamplingConfig(max_new_tokens=max_new_tokens))


def test_a_handed_on_group_goes_on_from_each_samples_progress_and_a_malformed_one_is_sampled_again():
    engine, prompt = Engine(), GroupPrompt([1, 2])
    good = Sample(completion_token_ids=[5, 6], logprobs=[-0.1, -0.2], token_versions=[3, 3])
    malformed = Sample(completion_token_ids=[5, 6], logprobs=[-0.1], token_versions=[3, 3])  # one log-prob
    s = sampler(engine)
    run = s.start("t", "g", prompt, 2, lineage=1, partial=[good, malformed])
    # the good sample continues after its 2 tokens, for the 4 - 2 left; the malformed one starts again
    assert sorted(engine.contexts.values()) == [[1, 2], [1, 2, 5, 6]]
    ended = []
    while s.running_samples:
        assert s.running_samples == sum(not p.ended for p in run.samples)
        ended += s.step(4)
    assert ended == [run]
    continued, again = run.samples
    assert (continued.token_ids, continued.versions) == ([5, 6, 7, 7], [3, 3, 4, 4])
    assert continued.continued_from == 2
    assert (again.token_ids, again.versions, again.continued_from) == ([7] * 4, [4] * 4, 0)


def test_weights_of_another_lineage_start_a_groups_samples_again_from_its_prompt():
    engine = Engine()
    s = sampler(engine)
    run = s.start("t", "g", GroupPrompt([1, 2]), 2, lineage=1)
    s.step(1)
    run.saved_tokens = run.tokens  # 2 tokens, saved
    first = set(engine.left)
    s.restart(["g"], lineage=2)
    assert not first & set(engine.left)  # the lineage-1 sequences aborted, two new ones from the prompt
    assert [engine.contexts[key] for key in engine.left] == [[1, 2], [1, 2]]
    assert (run.lineage, run.saved_tokens, [p.token_ids for p in run.samples]) == (2, 0, [[], []])
    while s.running_samples:
        s.step(5)
    assert [p.versions for p in run.samples] == [[5] * 4] * 2  # no lineage-1 token left

"""Single-turn samples in the continuous sampler (`asyncrlhf.sampling.continuous`): the `SampleKind` whose
samples are one engine sequence each, after the group's prompt ids, ended when it ends. A sample handed on
carries its tokens so far with their log-probs and versions; the generator that continues it samples the rest
with them as part of the prompt."""

from __future__ import annotations

from collections.abc import Callable, Collection
from dataclasses import dataclass, field
from typing import Any

from asyncrlhf._proto.rollout_pb2 import FinishReason, PromptGroup, RolloutGroup, Sample
from asyncrlhf.sampling.backend import Completion, Finish
from asyncrlhf.sampling.continuous import ContinuousSampler, GroupRun, Tokens
from asyncrlhf.sampling.rollouts import FINISH, FINISH_OF, rollout_group
from asyncrlhf.version import PolicyVersion


@dataclass
class Progress:
    """One single-turn sample: its tokens so far, their log-probs and the version that sampled each; `finish`
    once it ended. `continued_from`: tokens sampled by an earlier generator before it handed the sample on."""

    token_ids: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    versions: list[int] = field(default_factory=list)
    finish: Finish | None = None
    continued_from: int = 0

    @property
    def ended(self) -> bool:
        return self.finish is not None

    def completion(self) -> Completion:
        assert self.finish is not None, "only an ended sample is a completion"
        return Completion(list(self.token_ids), list(self.logprobs), self.finish, tuple(self.versions),
                          self.continued_from)


class Completions:
    """Single-turn samples (`SampleKind`): each is one engine sequence after the group's prompt ids, up to
    `max_new_tokens` in all, and ends with it; nothing runs off the engine's thread."""

    def fresh(self, partial: Sample | None) -> Progress:
        """A new sample, or `partial`'s tokens to go on from (a malformed one is sampled again)."""
        if partial is None:
            return Progress()
        ids, logps = list(partial.completion_token_ids), list(partial.logprobs)
        versions = list(partial.token_versions)
        if len(logps) != len(ids) or len(versions) != len(ids):
            return Progress()
        finish = FINISH_OF.get(partial.finish_reason)
        return Progress(ids, logps, versions, finish, len(ids) if finish is None else partial.continued_from)

    def begin(self, sampler: ContinuousSampler[Any, Progress], run: GroupRun[Any, Progress], j: int) -> None:
        sample = run.samples[j]
        if sample.ended:
            return
        left = sampler.sampling.max_new_tokens - len(sample.token_ids)
        if left <= 0:  # handed on at its last token: it ended by length
            sample.finish = "length"
            return
        sampler.add(run, j, run.prompt.ids + sample.token_ids, left)

    def sequence(self, sample: Progress) -> Tokens:
        return sample

    def sequence_ended(self, sampler: ContinuousSampler[Any, Progress], run: GroupRun[Any, Progress], j: int,
                       finish: Finish) -> None:
        run.samples[j].finish = finish

    def poll(self, sampler: ContinuousSampler[Any, Progress]) -> None:
        return None

    def waiting(self) -> int:
        return 0

    def settle(self, timeout_s: float) -> None:
        return None

    def forget(self, group_ids: Collection[str]) -> None:
        return None

    def partial(self, sample: Progress, decode: Callable[[list[int]], str]) -> Sample:
        finish = FINISH[sample.finish] if sample.finish else FinishReason.FINISH_REASON_UNSPECIFIED
        return Sample(completion_token_ids=sample.token_ids, logprobs=sample.logprobs,
                      token_versions=sample.versions, finish_reason=finish, text=decode(sample.token_ids),
                      continued_from=sample.continued_from)

    def rollout(self, prompt: PromptGroup, run: GroupRun[Any, Progress], version: PolicyVersion,
                generator_id: str, generated_at: float, decode: Callable[[list[int]], str]) -> RolloutGroup:
        return rollout_group(prompt, [s.completion() for s in run.samples], version, generator_id,
                             run.started_at, generated_at, decode)

    def close(self) -> None:
        return None

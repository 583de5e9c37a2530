"""Completions as the RolloutGroup the pipeline carries: what the generator service writes to the rollouts
stream, and what the in-process baseline (`asyncrlhf bench pipeline`) trains on without one."""

from __future__ import annotations

from collections.abc import Callable, Sequence

from asyncrlhf._proto.rollout_pb2 import FinishReason, PromptGroup, RolloutGroup, Sample
from asyncrlhf.sampling.backend import Completion, Finish
from asyncrlhf.version import PolicyVersion

FINISH: dict[Finish, FinishReason] = {"stop": FinishReason.FINISH_REASON_STOP,
                                      "length": FinishReason.FINISH_REASON_LENGTH}
FINISH_OF: dict[FinishReason, Finish] = {v: k for k, v in FINISH.items()}


def rollout_group(prompt: PromptGroup, completions: Sequence[Completion], version: PolicyVersion,
                  generator_id: str, started_at: float, generated_at: float,
                  decode: Callable[[list[int]], str]) -> RolloutGroup:
    """The RolloutGroup of one prompt's k completions, sampled by weights `version` (batch mode), or by the
    per-token versions each completion carries (continuous mode: `version` gives the lineage). The group's
    `policy_version` is its oldest token's, what the learner judges staleness on."""
    samples = [Sample(completion_token_ids=c.token_ids, logprobs=c.logprobs, finish_reason=FINISH[c.finish],
                      text=decode(c.token_ids), token_versions=c.versions, continued_from=c.continued_from)
               for c in completions]
    oldest = min((v for c in completions for v in c.versions), default=version.step)
    return RolloutGroup(group_id=prompt.group_id, prompt=prompt, samples=samples, policy_version=oldest,
                        generator_id=generator_id, generation_started_at=started_at,
                        generated_at=generated_at, lineage=version.lineage)


def handed_on(prompt: PromptGroup, partials: Sequence[Sample], lineage: int) -> PromptGroup:
    """The prompt group again, carrying its samples' progress (`partials`, sampled under weights of
    `lineage`), for another generator to continue."""
    out = PromptGroup()
    out.CopyFrom(prompt)
    del out.partial_samples[:]
    out.partial_samples.extend(partials)
    out.partial_lineage = lineage
    return out


def carried(prompt: PromptGroup, lineage: int) -> list[Sample]:
    """The samples a group carries (`partial_samples`) to continue under weights of `lineage`: none when
    they come from another lineage (they are sampled again from the prompt)."""
    return list(prompt.partial_samples) if prompt.partial_lineage == lineage else []

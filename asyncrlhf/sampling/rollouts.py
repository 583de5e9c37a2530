"""Completions as the RolloutGroup the pipeline carries: what the generator service writes to the rollouts
stream, and what the in-process baseline (`asyncrlhf bench pipeline`) trains on without one."""

from __future__ import annotations

from collections.abc import Callable, Sequence

from asyncrlhf._proto.rollout_pb2 import FinishReason, PromptGroup, RolloutGroup, Sample
from asyncrlhf.sampling.backend import Completion, Finish
from asyncrlhf.sampling.continuous import Progress
from asyncrlhf.version import PolicyVersion

FINISH = {"stop": FinishReason.FINISH_REASON_STOP, "length": FinishReason.FINISH_REASON_LENGTH}
_FINISH_OF: dict[int, Finish] = {v: k for k, v in FINISH.items()}  # type: ignore[misc]


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


def handed_on(prompt: PromptGroup, samples: Sequence[Progress], lineage: int,
              decode: Callable[[list[int]], str]) -> PromptGroup:
    """The prompt group again, carrying its samples' progress, for another generator to continue."""
    out = PromptGroup()
    out.CopyFrom(prompt)
    del out.partial_samples[:]
    out.partial_samples.extend(
        Sample(completion_token_ids=s.token_ids, logprobs=s.logprobs, token_versions=s.versions,
               finish_reason=FINISH[s.finish] if s.finish else FinishReason.FINISH_REASON_UNSPECIFIED,
               text=decode(s.token_ids), continued_from=s.continued_from) for s in samples)
    out.partial_lineage = lineage
    return out


def progress_of(prompt: PromptGroup, lineage: int) -> list[Progress]:
    """The samples a group carries (`partial_samples`) as progress to continue under weights of `lineage`:
    none when they come from another lineage, or are malformed (their tokens are sampled again)."""
    if prompt.partial_lineage != lineage:
        return []
    out = []
    for s in prompt.partial_samples:
        ids, logps, versions = list(s.completion_token_ids), list(s.logprobs), list(s.token_versions)
        if len(logps) != len(ids) or len(versions) != len(ids):
            return []
        out.append(Progress(ids, logps, versions, _FINISH_OF.get(s.finish_reason), s.continued_from))
    return out

"""Completions as the RolloutGroup the pipeline carries: what the generator service writes to the rollouts
stream, and what the in-process baseline (`asyncrlhf bench pipeline`) trains on without one."""

from __future__ import annotations

from collections.abc import Callable, Sequence

from asyncrlhf._proto.rollout_pb2 import FinishReason, PromptGroup, RolloutGroup, Sample
from asyncrlhf.sampling.backend import Completion
from asyncrlhf.version import PolicyVersion

FINISH = {"stop": FinishReason.FINISH_REASON_STOP, "length": FinishReason.FINISH_REASON_LENGTH}


def rollout_group(prompt: PromptGroup, completions: Sequence[Completion], version: PolicyVersion,
                  generator_id: str, started_at: float, generated_at: float,
                  decode: Callable[[list[int]], str]) -> RolloutGroup:
    """The RolloutGroup of one prompt's k completions, all sampled by weights `version`."""
    samples = [Sample(completion_token_ids=c.token_ids, logprobs=c.logprobs, finish_reason=FINISH[c.finish],
                      text=decode(c.token_ids)) for c in completions]
    return RolloutGroup(group_id=prompt.group_id, prompt=prompt, samples=samples, policy_version=version.step,
                        generator_id=generator_id, generation_started_at=started_at,
                        generated_at=generated_at, lineage=version.lineage)

"""A prompt's k episodes as the RolloutGroup the pipeline carries: each episode's tokens after the group's
prompt, with the loss mask, the environment's reward (in all and per turn), the turns and why the episode
ended."""

from __future__ import annotations

from collections.abc import Callable, Sequence

from asyncrlhf._proto.rollout_pb2 import PromptGroup, RolloutGroup
from asyncrlhf.envs.episode import Episode
from asyncrlhf.sampling.backend import Completion
from asyncrlhf.sampling.rollouts import rollout_group
from asyncrlhf.version import PolicyVersion


def common_prefix(rows: Sequence[Sequence[int]]) -> list[int]:
    first = list(rows[0])
    n = len(first)
    for row in rows[1:]:
        same = (i for i, (a, b) in enumerate(zip(first[:n], row, strict=False)) if a != b)
        n = next(same, min(n, len(row)))
    return first[:n]


def episode_group(prompt: PromptGroup, episodes: Sequence[Episode], version: PolicyVersion, generator_id: str,
                  started_at: float, generated_at: float, decode: Callable[[list[int]], str]) -> RolloutGroup:
    """The group's prompt becomes the episodes' first context (the environment's first observation with the
    tools, as rendered); where an environment opened its episodes differently, each episode's own opening
    beyond the shared prefix leads its completion as environment tokens (masked)."""
    prefix = common_prefix([e.prompt_ids for e in episodes])
    completions, masks = [], []
    for e in episodes:
        lead = e.prompt_ids[len(prefix):]
        first_version = e.versions[0] if e.versions else version.step
        carried = len(lead) + e.continued_from if e.continued_from else 0
        completions.append(Completion(lead + e.token_ids, [0.0] * len(lead) + e.logprobs, e.finish,
                                      tuple([first_version] * len(lead) + e.versions), carried))
        masks.append([0] * len(lead) + e.loss_mask)
    opened = PromptGroup()
    opened.CopyFrom(prompt)
    opened.prompt_token_ids[:] = prefix
    group = rollout_group(opened, completions, version, generator_id, started_at, generated_at, decode)
    for sample, e, mask in zip(group.samples, episodes, masks, strict=True):
        sample.loss_mask[:] = mask
        sample.env_reward = e.reward
        sample.turns = e.turns
        sample.turn_ends[:] = [end + len(mask) - len(e.loss_mask) for end in e.turn_ends]
        sample.turn_rewards[:] = e.turn_rewards
        assert e.end is not None, "only ended episodes are written"
        sample.episode_end = str(e.end)
    return group

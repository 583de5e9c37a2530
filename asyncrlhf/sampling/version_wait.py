"""Handed-on samples that wait until this generator serves their newest version.

A sample's token versions never go down: the learner refuses a group whose do (`token_versions`). A partial
sample handed on at version v (by a stopped generator, or saved by a killed one) can reach a generator that
still serves v-1: its push is still running, it is a relay leaf the version has not reached yet, or its push
failed and waits for the learner's late sync. Continued there, the sample would get v-1 tokens after v ones.
So the group waits here, pending in the stream and held by this consumer like a group in flight (no other
generator re-claims it and its delivery count does not grow), and starts the moment this generator serves v.

Why wait rather than let the learner accept one step down at `continued_from`: a sample's staleness is its
oldest token's and each token is corrected by its own version; a label older than the tokens before it would
make both readings wrong (and a sample can be handed on more than once). The wait is short: a push in
progress, a relay hop, or the learner's late sync, which fails the run if a generator keeps refusing pushes
(`learner.push_max_failures`). A generator stopped while groups wait hands them on again as they came.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Generic, TypeVar

from asyncrlhf._proto.rollout_pb2 import FinishReason, PromptGroup
from asyncrlhf.version import PolicyVersion

T = TypeVar("T")


def waits_for(prompt: PromptGroup, served: PolicyVersion) -> int | None:
    """The version a generator serving `served` must reach before it continues `prompt`'s partial samples, or
    None when it can start the group now: no unfinished partial sample, or one of another lineage (its tokens
    are sampled again from the prompt, `carried`), or none newer than `served`. Ended samples gain no
    tokens, so only the unfinished ones' versions count."""
    if prompt.partial_lineage != served.lineage:
        return None
    unfinished = FinishReason.FINISH_REASON_UNSPECIFIED
    newest = max((v for s in prompt.partial_samples if s.finish_reason == unfinished
                  for v in s.token_versions), default=0)
    return newest if newest > served.step else None


@dataclass
class Waiting(Generic[T]):
    """A group read but not started: `item` is the caller's (its delivery and work), `prompt` what it
    carries, `version` the one it waits for."""

    item: T
    prompt: PromptGroup
    version: int


class VersionWait(Generic[T]):
    """The groups waiting for this generator's version, by group id."""

    def __init__(self) -> None:
        self._groups: dict[str, Waiting[T]] = {}

    def __contains__(self, group_id: str) -> bool:
        return group_id in self._groups

    def add(self, group_id: str, item: T, prompt: PromptGroup, version: int) -> None:
        self._groups[group_id] = Waiting(item, prompt, version)

    def ready(self, served: PolicyVersion) -> list[Waiting[T]]:
        """The groups that can start under `served` (taken out), oldest first."""
        ready = [gid for gid, w in self._groups.items() if waits_for(w.prompt, served) is None]
        return [self._groups.pop(gid) for gid in ready]

    def items(self) -> list[Waiting[T]]:
        return list(self._groups.values())

    def take_all(self) -> list[Waiting[T]]:
        """Every group waiting (taken out): the generator stops."""
        groups, self._groups = list(self._groups.values()), {}
        return groups

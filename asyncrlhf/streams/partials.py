"""Samples in flight, saved by continuous generators so that a generator killed without warning loses only
the tokens since its last save: one hash, group id -> the PromptGroup with its `partial_samples` as saved.

A generator that reads a group (new, re-claimed from a dead consumer, or handed on) continues from whichever
is further along, the message's own partials or the saved ones; it forgets the save once the group is
written. A save left behind by a crash between the write and the forget is never read again (the group is
acked, so never delivered again) and is deleted with the run's other keys.
"""

from __future__ import annotations

from collections.abc import Sequence

import redis

from asyncrlhf._proto.rollout_pb2 import PromptGroup


def partial_tokens(prompt: PromptGroup) -> int:
    """Tokens sampled so far across a group's partial samples."""
    return sum(len(s.completion_token_ids) for s in prompt.partial_samples)


class PartialStore:
    def __init__(self, client: redis.Redis, key: str):
        self.client, self.key = client, key

    def save(self, groups: Sequence[PromptGroup]) -> None:
        """Save each group's progress (its `partial_samples`), replacing the earlier save, in one command."""
        if groups:
            self.client.hset(self.key, mapping={g.group_id: g.SerializeToString() for g in groups})

    def forget(self, group_ids: Sequence[str]) -> None:
        if group_ids:
            self.client.hdel(self.key, *group_ids)

    def further(self, prompts: Sequence[PromptGroup]) -> list[PromptGroup]:
        """Each message, or its saved progress when that is further along (the caller checks the lineage),
        in one command; a save that cannot be read costs its tokens, not the group."""
        if not prompts:
            return []
        raws = self.client.hmget(self.key, [p.group_id for p in prompts])
        return [_further(p, raw) for p, raw in zip(prompts, raws, strict=True)]


def _further(prompt: PromptGroup, raw: bytes | str | None) -> PromptGroup:
    if raw is None:
        return prompt
    try:
        saved = PromptGroup.FromString(raw)  # type: ignore[arg-type]  # a bytes client: bytes
    except Exception:  # a corrupt save: the group continues from the message
        return prompt
    return saved if partial_tokens(saved) > partial_tokens(prompt) else prompt

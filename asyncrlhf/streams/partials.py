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

    def load(self, group_id: str) -> PromptGroup | None:
        """The saved progress of a group, or None (none saved, or unreadable: the group restarts)."""
        raw = self.client.hget(self.key, group_id)
        if raw is None:
            return None
        try:
            return PromptGroup.FromString(raw)  # type: ignore[arg-type]
        except Exception:  # a corrupt save costs its tokens, not the group
            return None

    def forget(self, group_ids: Sequence[str]) -> None:
        if group_ids:
            self.client.hdel(self.key, *group_ids)

    def further(self, prompt: PromptGroup) -> PromptGroup:
        """The message, or its saved progress when that is further along (the caller checks the lineage)."""
        saved = self.load(prompt.group_id)
        if saved is None or partial_tokens(saved) <= partial_tokens(prompt):
            return prompt
        return saved

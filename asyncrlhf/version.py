"""`PolicyVersion`: which weights a thing was made by, as one ordered value.

Every push, registry entry, rollout and trained group carries `(lineage, step)`. A learner start begins a
new lineage (`consumed.ConsumedLog.begin`), and its steps count from the checkpoint it resumed from, so a
newer lineage may serve a lower step: versions order by lineage first, then step. Steps of two different
lineages do not measure staleness against each other. Lineage 0 is "not recorded" (rollouts written before
lineages existed, tests that push without one); it compares by step with any lineage.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True, order=True)
class PolicyVersion:
    """`lineage` (a learner start), then `step` (optimizer steps taken; 0 before the first push)."""

    lineage: int
    step: int

    def __post_init__(self) -> None:
        if self.lineage < 0 or self.step < 0:
            raise ValueError(f"a policy version is (lineage >= 0, step >= 0), "
                             f"got ({self.lineage}, {self.step})")

    def newer_than(self, other: PolicyVersion) -> bool:
        """Whether these weights replace `other`'s: a newer lineage at any step, or a later step of one."""
        return self > other

    def same_lineage(self, other: PolicyVersion) -> bool:
        """Whether steps of the two compare (lineage 0, "not recorded", compares with any)."""
        return not self.lineage or not other.lineage or self.lineage == other.lineage

    def staleness_from(self, current: PolicyVersion) -> int | None:
        """How many steps older these weights (what sampled) are than `current` (the learner's), or None when
        the two are of different lineages: such steps do not compare (the caller treats it as beyond any
        bound)."""
        if not self.same_lineage(current):
            return None
        return current.step - self.step

    def __str__(self) -> str:
        return f"{self.step} (lineage {self.lineage})"

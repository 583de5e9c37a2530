"""Admission of one scored group: a pure judgement, no Redis and no I/O.

A group is admitted once. In order: a group that already ended for this lineage's model (trained before a
crash and redelivered) is a duplicate, acked and never trained twice; a group the learner cannot train on is
dead-lettered (among the reasons: per-token versions that do not fit its tokens, decrease, or are newer than
the learner's); then its staleness is judged, on its oldest token (`asyncrlhf.token_versions`). Under
`learner.staleness_mode: bound` the judgement is `asyncrlhf.algorithms.staleness_decision` (trained as is,
corrected, or dropped beyond `max_staleness`; a group whose tokens span versions is corrected per token),
with staleness measured by `PolicyVersion.staleness_from` (versions of another lineage do not compare: such a
group counts as beyond the bound). Under a controlled mode (`exact`, `paper`) a group all of whose tokens
are of the open window's version is held until its step, any other is dropped as off-schedule. A group whose
earlier training was lost with a learner is never dropped: it is enqueued again, sampled afresh from the
current weights. With dynamic sampling (`Rules.filter_reason`), a group admitted for training whose rewards
are all equal is filtered instead (`asyncrlhf.algorithms.uninformative`), unless its earlier training was
lost (its update must be redone).
"""

from __future__ import annotations

from collections.abc import Set
from dataclasses import dataclass, replace
from enum import StrEnum

import torch

from asyncrlhf._proto.rollout_pb2 import RolloutGroup
from asyncrlhf.algorithms import StalenessDecision, staleness_decision, uninformative
from asyncrlhf.algorithms.offpolicy import StalePolicy
from asyncrlhf.token_versions import token_versions_problem, version_span
from asyncrlhf.training.batch import validate_group
from asyncrlhf.version import PolicyVersion

OFF_SCHEDULE = "off-schedule"


class Action(StrEnum):
    DUPLICATE = "duplicate"  # ended before: ack, nothing else
    INVALID = "invalid"  # cannot be trained on: dead-letter (its credit comes back through the reaper)
    TRAIN = "train"  # into the step being collected
    HOLD = "hold"  # controlled staleness: kept until the step its version is due
    DROP = "drop"  # ends untrained
    REQUEUE = "requeue"  # its update was lost and it would be dropped: enqueue its prompt again
    FILTER = "filter"  # no reward signal (dynamic sampling): ends untrained, the step takes another


@dataclass(frozen=True)
class Verdict:
    action: Action
    decision: StalenessDecision | None = None  # the judgement against `max_staleness` (bound mode)
    staleness: int = 0  # versions between the sampling weights and the learner's
    reason: str = ""  # why it is dead-lettered or dropped (empty: beyond the bound)
    old_lineage: bool = False  # sampled by another lineage's weights


@dataclass(frozen=True)
class Rules:
    """What admission judges by: `samples_per_prompt`, the staleness bound and policy, and under a
    controlled mode the version whose window is open (None under `bound`); with dynamic sampling, the reason
    an uninformative group is filtered for (None: not filtered)."""

    samples_per_prompt: int
    max_staleness: int
    stale_policy: StalePolicy
    window: int | None = None
    filter_reason: str | None = None


@dataclass(frozen=True)
class Known:
    """What the learner knows of group ids: `ended` for this lineage's model, `retrain` (trained only outside
    its history: update lost), `held` back for a later step."""

    ended: Set[str]
    retrain: Set[str] = frozenset()
    held: Set[str] = frozenset()


def admit(group_id: str, group: RolloutGroup, current: PolicyVersion, rules: Rules, known: Known) -> Verdict:
    """The verdict on scored group `group` (id `group_id`) read by a learner at `current`."""
    if group_id in known.ended:
        return Verdict(Action.DUPLICATE)
    if group_id in known.held:  # re-claimed: the same entry, admitted before
        return Verdict(Action.HOLD)
    problem = validate_group(group, rules.samples_per_prompt) or token_versions_problem(group, current)
    if problem:
        return Verdict(Action.INVALID, reason=f"learner cannot train on it: {problem}")
    verdict = _judge(group, current, rules)
    if verdict.action is Action.DROP and group_id in known.retrain:
        # Dropping it would leave a group logged as trained in no model: sample it again instead.
        return replace(verdict, action=Action.REQUEUE)
    if (verdict.action is Action.TRAIN and rules.filter_reason and group_id not in known.retrain
            and bool(uninformative(torch.tensor([[s.reward for s in group.samples]]))[0])):
        return replace(verdict, action=Action.FILTER, reason=rules.filter_reason)
    return verdict


def _judge(group: RolloutGroup, current: PolicyVersion, rules: Rules) -> Verdict:
    oldest, newest = version_span(group)
    staleness = current.step - oldest
    if rules.window is not None:  # no group is generated across a push: every token of the window's version
        if oldest == newest == rules.window:
            return Verdict(Action.HOLD, staleness=staleness)
        return Verdict(Action.DROP, staleness=staleness, reason=OFF_SCHEDULE)
    measured = PolicyVersion(group.lineage, oldest).staleness_from(current)
    old_lineage = measured is None
    if measured is None:  # versions of another lineage do not compare: beyond the bound, every token
        measured = max(rules.max_staleness + 1, staleness)
    decision = staleness_decision(current.step - measured, current.step, rules.max_staleness,
                                  rules.stale_policy, None if old_lineage or oldest == newest else newest)
    action = Action.TRAIN if decision.trained else Action.DROP
    return Verdict(action, decision, decision.staleness, old_lineage=old_lineage)

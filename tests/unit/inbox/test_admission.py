"""`admit`: the verdict on one scored group, by hand-computed cases; no Redis."""

from __future__ import annotations

import pytest

from asyncrlhf._proto.rollout_pb2 import PromptGroup, RolloutGroup, Sample
from asyncrlhf.algorithms import StalenessDecision
from asyncrlhf.inbox.admission import OFF_SCHEDULE, Action, Known, Rules, Verdict, admit
from asyncrlhf.version import PolicyVersion

pytestmark = pytest.mark.unit
K = 2
BOUND = Rules(samples_per_prompt=K, max_staleness=1, stale_policy="drop")
NOW = PolicyVersion(lineage=2, step=5)  # the learner: lineage 2, version 5
NOTHING = Known(frozenset())


def group(version: int, lineage: int = 2, samples: int = K, gid: str = "g00000007") -> RolloutGroup:
    return RolloutGroup(group_id=gid, prompt=PromptGroup(group_id=gid, prompt_token_ids=[5, 6], k=K),
                        samples=[Sample(completion_token_ids=[7], logprobs=[-1.0], reward=1.0)] * samples,
                        policy_version=version, lineage=lineage)


def verdict(g: RolloutGroup, rules: Rules = BOUND, known: Known = NOTHING) -> Verdict:
    return admit(g.group_id, g, NOW, rules, known)


def test_a_group_that_ended_is_a_duplicate_whatever_it_holds():
    assert verdict(group(5, samples=0), known=Known({"g00000007"})) == Verdict(Action.DUPLICATE)


def test_a_group_that_cannot_be_trained_on_is_invalid_with_the_reason():
    assert verdict(group(5, samples=1)) == Verdict(
        Action.INVALID, reason="learner cannot train on it: expected 2 samples, got 1")


@pytest.mark.parametrize("generated_by, policy, expected", [
    (5, "drop", StalenessDecision(0, "fresh")),  # 5 - 5 = 0 <= 1
    (4, "drop", StalenessDecision(1, "fresh")),  # 5 - 4 = 1 <= 1: the bound itself is fresh
    (3, "drop", StalenessDecision(2, "drop")),  # 5 - 3 = 2 > 1
    (3, "tis", StalenessDecision(2, "correct")),  # importance-corrected
    (1, "keep", StalenessDecision(4, "keep")),  # 5 - 1 = 4 > 1, trained as is
])
def test_bound_mode_judges_staleness_against_max_staleness(generated_by, policy, expected):
    rules = Rules(K, max_staleness=1, stale_policy=policy)
    result = verdict(group(generated_by), rules)
    assert result.decision == expected and result.staleness == expected.staleness
    assert result.action is (Action.TRAIN if expected.trained else Action.DROP)
    assert not result.old_lineage


def test_another_lineages_versions_do_not_compare_so_its_group_is_beyond_the_bound():
    # lineage 1's version 9 beside lineage 2's version 5: max(max_staleness + 1, 5 - 9) = max(2, -4) = 2
    assert verdict(group(9, lineage=1)) == Verdict(Action.DROP, StalenessDecision(2, "drop"), 2,
                                                   old_lineage=True)
    # lineage 1's version 1: max(2, 5 - 1) = 4
    assert verdict(group(1, lineage=1)).staleness == 4


def test_lineage_zero_is_not_recorded_and_compares_by_step():
    assert verdict(group(4, lineage=0)) == Verdict(Action.TRAIN, StalenessDecision(1, "fresh"), 1)


def test_a_group_whose_update_was_lost_is_requeued_rather_than_dropped():
    known = Known(frozenset(), retrain={"g00000007"})
    assert verdict(group(3), known=known) == Verdict(Action.REQUEUE, StalenessDecision(2, "drop"), 2)
    assert verdict(group(5), known=known).action is Action.TRAIN  # trained again: nothing to do


def test_controlled_mode_holds_the_open_windows_groups_and_drops_any_other_as_off_schedule():
    windowed = Rules(K, max_staleness=1, stale_policy="drop", window=4)
    assert verdict(group(4), windowed) == Verdict(Action.HOLD, staleness=1)  # 5 - 4
    assert verdict(group(3), windowed) == Verdict(Action.DROP, staleness=2, reason=OFF_SCHEDULE)  # 5 - 3
    assert verdict(group(3), windowed, Known(frozenset(), retrain={"g00000007"})).action is Action.REQUEUE


def test_a_held_group_delivered_again_is_held_again_before_any_check():
    windowed = Rules(K, max_staleness=1, stale_policy="drop", window=4)
    held = Known(frozenset(), held={"g00000007"})
    assert verdict(group(3, samples=0), windowed, held) == Verdict(Action.HOLD)

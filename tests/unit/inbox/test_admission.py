"""`admit`: the verdict on one scored group, by hand-computed cases; no Redis."""

from __future__ import annotations

from dataclasses import replace

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


# -- per-token versions (continuous mode): judged on the oldest token, malformed ones dead-lettered ----------

def spanning(versions: list[list[int]], policy_version: int, lineage: int = 2) -> RolloutGroup:
    """A group whose sample i has one token per entry of versions[i], each tagged with that version."""
    samples = [Sample(completion_token_ids=[7] * len(v), logprobs=[-1.0] * len(v), reward=1.0,
                      token_versions=v) for v in versions]
    prompt = PromptGroup(group_id="g00000007", prompt_token_ids=[5, 6], k=K)
    return RolloutGroup(group_id="g00000007", prompt=prompt, samples=samples, policy_version=policy_version,
                        lineage=lineage)


def test_a_group_is_judged_on_its_oldest_token_across_its_samples():
    # sample 0 spans 3..5, sample 1 is all 5: the oldest token is 3, so 5 - 3 = 2 > max_staleness 1
    tis = Rules(K, max_staleness=1, stale_policy="tis")
    result = verdict(spanning([[3, 4, 5], [5, 5]], policy_version=3), tis)
    # tokens of 5 - 1 = 4 or newer are within the bound (fresh); only the version-3 token is corrected
    assert result == Verdict(Action.TRAIN, StalenessDecision(2, "correct", fresh_from=4), 2)
    assert [result.decision.corrects(v) for v in (3, 4, 5)] == [True, False, False]
    # the same group under drop: dropped whole, judged on its oldest token
    assert verdict(spanning([[3, 4, 5], [5, 5]], policy_version=3)) == Verdict(
        Action.DROP, StalenessDecision(2, "drop"), 2)


def test_a_group_whose_tokens_span_versions_within_the_bound_is_fresh():
    # oldest 4: 5 - 4 = 1 <= 1
    assert verdict(spanning([[4, 5], [5, 5]], policy_version=4)) == Verdict(
        Action.TRAIN, StalenessDecision(1, "fresh"), 1)


def test_the_oldest_token_wins_over_a_policy_version_set_too_new():
    # the generator claims version 5 while a token was sampled by 3: min(5, 3, 5) = 3, 5 - 3 = 2 > 1
    assert verdict(spanning([[3, 5], [5, 5]], policy_version=5)).staleness == 2
    # and the other way round: policy_version 3 older than every token still counts (min(3, 5) = 3)
    assert verdict(spanning([[5, 5], [5, 5]], policy_version=3)).staleness == 2


def test_another_lineages_spanning_group_is_corrected_on_every_token():
    tis = Rules(K, max_staleness=1, stale_policy="tis")
    # lineage 1's 9..12 beside lineage 2's 5: max(2, 5 - 9) = 2, and no token of a dead lineage is fresh
    result = verdict(spanning([[9, 12], [9, 9]], policy_version=9, lineage=1), tis)
    assert result.decision == StalenessDecision(2, "correct") and result.old_lineage
    assert result.decision.corrects(12)


def test_token_versions_that_do_not_fit_the_tokens_are_dead_lettered():
    g = spanning([[4, 5], [5]], policy_version=4)
    g.samples[0].token_versions.append(5)  # three versions for two tokens
    assert verdict(g) == Verdict(
        Action.INVALID, reason="learner cannot train on it: sample 0: 3 token versions for 2 tokens")


@pytest.mark.parametrize("versions, reason", [
    ([[5, 4], [5, 5]], "sample 0: token versions decrease (4 after 5 at token 1)"),
    ([[5, 5], [5, 6]], "sample 1: a token sampled by version 6, newer than the learner's 5"),
])
def test_malformed_token_versions_are_dead_lettered_with_the_reason(versions, reason):
    assert verdict(spanning(versions, policy_version=4)) == Verdict(
        Action.INVALID, reason=f"learner cannot train on it: {reason}")


def test_versions_of_another_lineage_may_be_higher_than_the_learners():
    # lineage 1's version 9 is no newer than lineage 2's 5: it does not compare (beyond the bound, dropped)
    assert verdict(spanning([[9, 9], [9, 9]], policy_version=9, lineage=1)).action is Action.DROP


def test_controlled_mode_holds_only_a_group_wholly_of_the_window():
    windowed = Rules(K, max_staleness=1, stale_policy="drop", window=4)
    assert verdict(spanning([[4, 4], [4]], policy_version=4), windowed).action is Action.HOLD
    # generated across a push (4 then 5): not the window's, off-schedule
    assert verdict(spanning([[4, 5], [4]], policy_version=4), windowed) == Verdict(
        Action.DROP, staleness=1, reason=OFF_SCHEDULE)


FILTERING = Rules(samples_per_prompt=K, max_staleness=1, stale_policy="drop", filter_reason="zero_variance")


def rewarded(rewards: list[float], version: int = 5) -> RolloutGroup:
    g = group(version)
    for sample, reward in zip(g.samples, rewards, strict=True):
        sample.reward = reward
    return g


def test_dynamic_sampling_filters_a_group_whose_rewards_are_all_equal_and_keeps_one_with_signal():
    tied = verdict(rewarded([0.5, 0.5]), FILTERING)
    assert (tied.action, tied.reason, tied.decision) == (Action.FILTER, "zero_variance",
                                                         StalenessDecision(0, "fresh"))
    assert verdict(rewarded([0.5, 0.25]), FILTERING).action is Action.TRAIN
    assert verdict(rewarded([0.5, 0.5]), BOUND).action is Action.TRAIN  # dynamic sampling off


def test_dynamic_sampling_drops_a_stale_group_as_stale_and_never_filters_a_group_whose_update_was_lost():
    assert verdict(rewarded([1.0, 1.0], version=3), FILTERING).action is Action.DROP  # 5 - 3 > 1
    retrain = Known(frozenset(), retrain={"g00000007"})
    assert verdict(rewarded([1.0, 1.0]), FILTERING, retrain).action is Action.TRAIN


def test_in_continuous_mode_a_long_answer_beyond_the_bound_is_corrected_not_dropped():
    # A long answer's first tokens outlive max_staleness while short answers cycle (issue 48, fault 4). Left
    # unset, continuous mode's stale_policy is tis: its tokens beyond the bound are importance-corrected and
    # those within it stay fresh; batch mode keeps drop.
    from asyncrlhf.config import load_config
    from asyncrlhf.inbox.inbox import admission_rules

    continuous = admission_rules(load_config(["configs/tiny.yaml"], ["generator.mode=continuous",
                                                                     "learner.max_staleness=1"]))
    batch = admission_rules(load_config(["configs/tiny.yaml"], ["learner.max_staleness=1"]))
    assert (continuous.stale_policy, batch.stale_policy) == ("tis", "drop")
    sample = Sample(completion_token_ids=[7] * 4, logprobs=[-1.0] * 4, reward=1, token_versions=[2, 3, 4, 5])
    long = RolloutGroup(group_id="g00000009", prompt=PromptGroup(group_id="g00000009", prompt_token_ids=[5]),
                        samples=[sample] * 2, policy_version=2, lineage=2)
    judged = admit("g00000009", long, NOW, replace(continuous, samples_per_prompt=2), NOTHING)
    # staleness 5 - 2 = 3 > 1: corrected; fresh from 5 - 1 = 4, so versions 2 and 3 are corrected, 4 and 5 not
    assert (judged.action, judged.decision) == (Action.TRAIN, StalenessDecision(3, "correct", fresh_from=4))
    assert admit("g00000009", long, NOW, replace(batch, samples_per_prompt=2), NOTHING).action is Action.DROP

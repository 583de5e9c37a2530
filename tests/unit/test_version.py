import pytest

from asyncrlhf.version import PolicyVersion


def test_orders_by_lineage_then_step():
    # a restarted learner (lineage 2) resumes at step 3, below the 7 its predecessor reached: still newer
    assert PolicyVersion(2, 3).newer_than(PolicyVersion(1, 7))
    assert PolicyVersion(1, 8).newer_than(PolicyVersion(1, 7))
    assert not PolicyVersion(1, 7).newer_than(PolicyVersion(1, 7))
    assert not PolicyVersion(1, 7).newer_than(PolicyVersion(2, 0))
    assert sorted([PolicyVersion(2, 1), PolicyVersion(1, 9), PolicyVersion(1, 2)]) == [
        PolicyVersion(1, 2), PolicyVersion(1, 9), PolicyVersion(2, 1)]


def test_staleness_is_steps_behind_within_a_lineage():
    assert PolicyVersion(1, 5).staleness_from(PolicyVersion(1, 7)) == 2  # 7 - 5
    assert PolicyVersion(1, 7).staleness_from(PolicyVersion(1, 7)) == 0


def test_staleness_across_lineages_does_not_compare():
    assert PolicyVersion(1, 5).staleness_from(PolicyVersion(2, 7)) is None


def test_lineage_zero_means_not_recorded_and_compares_by_step():
    assert PolicyVersion(0, 5).staleness_from(PolicyVersion(3, 6)) == 1


def test_negative_parts_are_refused():
    with pytest.raises(ValueError, match="lineage >= 0"):
        PolicyVersion(-1, 0)
    with pytest.raises(ValueError, match="step >= 0"):
        PolicyVersion(0, -2)

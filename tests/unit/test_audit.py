"""`asyncrlhf.audit.account`: every enqueued group ends exactly once, or is in flight within the bound."""

import pytest

from asyncrlhf.audit import account, format_audit
from asyncrlhf.consumed import Kind

pytestmark = pytest.mark.unit


def rows(*spec):
    return [{"kind": kind, "version": 1, "group_ids": ids} for kind, ids in spec]


def test_a_clean_run_accounts_for_every_group():
    # g0..g5 enqueued: g0 g1 trained, g2 dropped, g3 dead-lettered (in the log and the stream), g4 g5 in
    # flight (scored, rollouts); the hand-made dead letter `junk` is reported apart and harms nothing.
    audit = account(
        6,
        rows(
            (Kind.TRAINED, ["g00000000", "g00000001"]),
            (Kind.DROPPED, ["g00000002"]),
            (Kind.DEAD_LETTERED, ["g00000003"]),
        ),
        [("rollouts", "g00000003", "cannot decode RolloutGroup: Error parsing"), ("prompts", "junk", "x")],
        {"prompts": set(), "rollouts": {"g00000005"}, "scored": {"g00000004"}},
        credit_bound=4,
    )
    assert audit.ok, format_audit(audit, "t")
    assert (audit.trained, audit.dropped, audit.dead_lettered) == (2, 1, 1)
    assert audit.in_flight == {"prompts": 0, "rollouts": 1, "scored": 1} and audit.in_flight_total == 2
    assert audit.dead_letter_reasons == {"cannot decode RolloutGroup": 1} and audit.foreign_dead_letters == 1


def test_a_group_in_no_stream_and_no_log_is_lost():
    audit = account(3, rows((Kind.TRAINED, ["g00000000"])), [], {"scored": {"g00000002"}})
    assert not audit.ok and audit.lost == ["g00000001"]
    assert "LOST" in format_audit(audit, "t") and format_audit(audit, "t").endswith("FAILED")


def test_training_a_group_twice_fails_even_across_restarts():
    twice = rows((Kind.TRAINED, ["g00000000", "g00000001"]), (Kind.TRAINED, ["g00000001"]))
    audit = account(2, twice, [], {})
    assert not audit.ok and audit.trained_twice == ["g00000001"]


def test_a_group_that_ended_two_ways_in_the_log_fails():
    # logged dead-lettered, then trained from another copy: its credit came back twice
    audit = account(1, rows((Kind.DEAD_LETTERED, ["g00000000"]), (Kind.TRAINED, ["g00000000"])), [], {})
    assert not audit.ok and audit.conflicting == ["g00000000"]


def test_a_dead_lettered_copy_of_a_trained_group_is_not_a_second_ending():
    # one delivery timed out too often and was dead-lettered after another copy was trained: the learner
    # skips dead letters of groups it already finished, so the group ended once, as trained
    dead = [("prompts", "g00000000", "delivered 4 times")]
    audit = account(1, rows((Kind.TRAINED, ["g00000000"])), dead, {})
    assert audit.ok and audit.trained == 1 and audit.dead_lettered == 0


def test_a_trained_group_still_in_a_stream_is_trained_not_in_flight():
    # the learner logged it (fsync) and died before the ack: the entry is still pending in `scored`
    audit = account(1, rows((Kind.TRAINED, ["g00000000"])), [], {"scored": {"g00000000"}}, credit_bound=1)
    assert audit.ok and audit.trained == 1 and audit.in_flight_total == 0


def test_more_in_flight_than_the_credit_bound_fails():
    audit = account(3, [], [], {"prompts": {"g00000000", "g00000001", "g00000002"}}, credit_bound=2)
    assert not audit.ok and audit.over_bound and "CREDIT BOUND" in format_audit(audit, "t")


def test_an_ended_group_beyond_the_cursor_is_unknown():
    audit = account(1, rows((Kind.TRAINED, ["g00000000", "g00000007"])), [], {})
    assert not audit.ok and audit.unknown == ["g00000007"]


def test_a_live_run_that_enqueued_and_ended_groups_between_the_reads_is_clean():
    # the cursor read 2 (g0 g1); meanwhile the learner enqueued g2 g3 and trained g2 and dead-lettered g3
    # before the log and the dead letters were read; the cursor read again says 4: g2 g3 are newer than the
    # audit, neither unknown nor foreign; g9, beyond the second read too, is unknown
    live = rows((Kind.TRAINED, ["g00000000", "g00000001", "g00000002"]))
    dead = [("scored", "g00000003", "cannot decode")]
    audit = account(2, live, dead, {}, enqueued_by_end=4)
    assert audit.ok, format_audit(audit, "t")
    assert (audit.trained, audit.dead_lettered, audit.foreign_dead_letters) == (2, 0, 0)
    assert not account(2, live, dead, {}).ok  # read once: g2 looks never enqueued
    beyond = rows((Kind.TRAINED, ["g00000000", "g00000001", "g00000009"]))
    stray = account(2, beyond, [], {}, enqueued_by_end=4)
    assert stray.unknown == ["g00000009"]


def lineage(n, parent, version):
    return {"kind": Kind.LINEAGE, "lineage": n, "from_lineage": parent, "version": version, "group_ids": []}


def trained(n, version, ids):
    return {"kind": Kind.TRAINED, "lineage": n, "version": version, "group_ids": ids}


def test_a_group_retrained_after_a_resume_is_in_the_final_history_once():
    rows = [lineage(1, 0, 0), trained(1, 2, ["g00000000"]), trained(1, 3, ["g00000001"]),
            lineage(2, 1, 2), {"kind": Kind.REQUEUED, "lineage": 2, "version": 2, "group_ids": ["g00000001"]},
            trained(2, 3, ["g00000001"])]
    audit = account(2, rows, [], {}, credit_bound=2)
    assert audit.ok, format_audit(audit, "t")
    assert audit.trained == 2 and audit.trained_twice == [] and audit.updates_lost == []
    first, second = audit.lineages
    assert (first.trained, first.in_final_history) == (2, 1)
    assert (second.from_lineage, second.from_version, second.requeued) == (1, 2, 1)
    assert "lineage 2   from lineage 1 at version 2" in format_audit(audit, "t")


def test_a_group_whose_update_was_lost_and_never_retrained_fails():
    rows = [lineage(1, 0, 0), trained(1, 2, ["g00000000"]), trained(1, 3, ["g00000001"]), lineage(2, 1, 2)]
    audit = account(2, rows, [], {})
    assert not audit.ok and audit.updates_lost == ["g00000001"] and audit.lost == []
    assert "UPDATE LOST" in format_audit(audit, "t")
    in_flight = account(2, rows, [], {"prompts": {"g00000001"}})  # enqueued again, not yet trained: fine
    assert in_flight.ok and in_flight.updates_lost == []


def test_training_twice_within_the_final_history_fails_across_lineages():
    rows = [lineage(1, 0, 0), trained(1, 2, ["g00000000"]), lineage(2, 1, 2), trained(2, 3, ["g00000000"])]
    audit = account(1, rows, [], {})
    assert not audit.ok and audit.trained_twice == ["g00000000"]


def test_a_group_dropped_after_its_update_was_lost_is_an_update_lost():
    rows = [lineage(1, 0, 0), trained(1, 2, ["g00000000"]), lineage(2, 0, 0),
            {"kind": Kind.DROPPED, "version": 1, "group_ids": ["g00000000"]}]
    audit = account(1, rows, [], {})
    assert not audit.ok and audit.updates_lost == ["g00000000"]


def test_continued_samples_are_counted_once_from_the_final_history():
    """Continuous generation: a trained group's samples continued from tokens sampled elsewhere are counted
    (groups, samples, carried tokens), but only for trainings the final model holds."""
    rows = [lineage(1, 0, 0), {**trained(1, 1, ["g00000000", "g00000001"]),
                               "continued": {"g00000001": [2, 57]}},
            {**trained(1, 2, ["g00000002"]), "continued": {"g00000002": [1, 9]}},  # update lost below
            lineage(2, 1, 1), {"kind": Kind.REQUEUED, "lineage": 2, "version": 1, "group_ids": ["g00000002"]},
            {**trained(2, 2, ["g00000002"]), "continued": {"g00000002": [1, 12]}}]
    audit = account(3, rows, [], {}, credit_bound=4)
    assert audit.ok, format_audit(audit, "t")
    assert audit.continued == {"groups": 2, "samples": 3, "tokens": 69}
    assert "continued      3 samples in 2 trained groups carried 69 tokens" in format_audit(audit, "t")


def test_saved_progress_is_in_flight_or_left_by_a_crash_and_never_for_a_group_never_enqueued():
    from asyncrlhf.audit import account_saved

    log = rows((Kind.TRAINED, ["g00000000"]), (Kind.DROPPED, ["g00000001"]))
    audit = account(4, log, [], {"prompts": {"g00000002", "g00000003"}}, credit_bound=4)
    account_saved(audit, ["g00000000", "g00000002", "g00000003"], log, 4)
    assert audit.ok and audit.saved_progress == {"in_flight": 2, "ended": 1}
    account_saved(audit, ["g00000002", "g00000007"], log, 4)  # g7: the learner never enqueued it
    assert not audit.ok and audit.saved_unknown == ["g00000007"]
    assert "PROGRESS SAVED FOR A GROUP NEVER ENQUEUED" in format_audit(audit, "t")


def test_a_group_filtered_by_dynamic_sampling_is_accounted_for_and_never_trained_too():
    # g0 g1 trained, g2 filtered (its rewards all equal) and g3, its refill, trained in the next step
    audit = account(4, rows((Kind.TRAINED, ["g00000000", "g00000001"]), (Kind.FILTERED, ["g00000002"]),
                            (Kind.TRAINED, ["g00000003"])), [], {}, credit_bound=4)
    assert audit.ok, format_audit(audit, "t")
    assert (audit.trained, audit.filtered, audit.lost) == (3, 1, [])
    assert "filtered       1" in format_audit(audit, "t")
    # a filtered group that was trained as well ended in two ways: a failure
    twice = account(1, rows((Kind.FILTERED, ["g00000000"]), (Kind.TRAINED, ["g00000000"])), [], {})
    assert twice.conflicting == ["g00000000"] and not twice.ok

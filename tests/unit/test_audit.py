"""`asyncrlhf.audit.account`: every enqueued group ends exactly once, or is in flight within the bound."""

import pytest

from asyncrlhf.audit import account, format_audit

pytestmark = pytest.mark.unit


def rows(*spec):
    return [{"kind": kind, "version": 1, "group_ids": ids} for kind, ids in spec]


def test_a_clean_run_accounts_for_every_group():
    # g0..g5 enqueued: g0 g1 trained, g2 dropped, g3 dead-lettered (in the log and the stream), g4 g5 in
    # flight (scored, rollouts); the hand-made dead letter `junk` is reported apart and harms nothing.
    audit = account(
        6,
        rows(
            ("trained", ["g00000000", "g00000001"]),
            ("dropped", ["g00000002"]),
            ("dead_lettered", ["g00000003"]),
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
    audit = account(3, rows(("trained", ["g00000000"])), [], {"scored": {"g00000002"}})
    assert not audit.ok and audit.lost == ["g00000001"]
    assert "LOST" in format_audit(audit, "t") and format_audit(audit, "t").endswith("FAILED")


def test_training_a_group_twice_fails_even_across_restarts():
    audit = account(2, rows(("trained", ["g00000000", "g00000001"]), ("trained", ["g00000001"])), [], {})
    assert not audit.ok and audit.trained_twice == ["g00000001"]


def test_a_group_that_ended_two_ways_in_the_log_fails():
    # logged dead-lettered, then trained from another copy: its credit came back twice
    audit = account(1, rows(("dead_lettered", ["g00000000"]), ("trained", ["g00000000"])), [], {})
    assert not audit.ok and audit.conflicting == ["g00000000"]


def test_a_dead_lettered_copy_of_a_trained_group_is_not_a_second_ending():
    # one delivery timed out too often and was dead-lettered after another copy was trained: the learner
    # skips dead letters of groups it already finished, so the group ended once, as trained
    audit = account(1, rows(("trained", ["g00000000"])), [("prompts", "g00000000", "delivered 4 times")], {})
    assert audit.ok and audit.trained == 1 and audit.dead_lettered == 0


def test_a_trained_group_still_in_a_stream_is_trained_not_in_flight():
    # the learner logged it (fsync) and died before the ack: the entry is still pending in `scored`
    audit = account(1, rows(("trained", ["g00000000"])), [], {"scored": {"g00000000"}}, credit_bound=1)
    assert audit.ok and audit.trained == 1 and audit.in_flight_total == 0


def test_more_in_flight_than_the_credit_bound_fails():
    audit = account(3, [], [], {"prompts": {"g00000000", "g00000001", "g00000002"}}, credit_bound=2)
    assert not audit.ok and audit.over_bound and "CREDIT BOUND" in format_audit(audit, "t")


def test_an_ended_group_beyond_the_cursor_is_unknown():
    audit = account(1, rows(("trained", ["g00000000", "g00000007"])), [], {})
    assert not audit.ok and audit.unknown == ["g00000007"]

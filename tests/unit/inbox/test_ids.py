"""Group ids: written and parsed in one place."""

import pytest

from asyncrlhf.inbox.ids import enqueued_below, group_id, group_index

pytestmark = pytest.mark.unit


def test_an_id_is_the_cursor_in_at_least_eight_digits_and_parses_back():
    assert group_id(0) == "g00000000" and group_id(123) == "g00000123"
    assert group_id(123_456_789) == "g123456789"  # nine digits: still one of the feed's
    assert [group_index(group_id(i)) for i in (0, 7, 123_456_789)] == [0, 7, 123_456_789]


@pytest.mark.parametrize("other", ["g1", "x00000001", "g0000000a", "g00000001 ", ""])
def test_an_id_no_feed_writes_parses_to_minus_one(other):
    assert group_index(other) == -1 and not enqueued_below(other, 10**9)


def test_enqueued_below_is_the_cursor_bound():
    assert enqueued_below("g00000004", 5) and not enqueued_below("g00000005", 5)

"""Prompt group ids, `g<cursor>`: the one place that writes and parses them.

The learner's feed names the cursor-th group it ever enqueued `g` + the cursor in at least eight digits, so
ids sort in enqueue order; any other id (a dead letter written by hand, another producer's entry) is not one
of the feed's.
"""

from __future__ import annotations

import re

_GROUP_ID = re.compile(r"g(\d{8,})")


def group_id(cursor: int) -> str:
    """The id of the cursor-th group a feed enqueues."""
    return f"g{cursor:08d}"


def group_index(group: str) -> int:
    """The cursor at which a feed enqueued `group`, or -1 for an id no feed writes."""
    match = _GROUP_ID.fullmatch(group)
    return int(match.group(1)) if match else -1


def enqueued_below(group: str, cursor: int) -> bool:
    """Whether `group` is one of the first `cursor` groups a feed enqueued."""
    return 0 <= group_index(group) < cursor

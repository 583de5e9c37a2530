"""A handed-on group waits until this generator serves the newest version its unfinished samples were sampled
by (so a sample's token versions never go down); ended samples, and progress of another lineage (sampled
again), never make it wait."""

from __future__ import annotations

import pytest

from asyncrlhf._proto.rollout_pb2 import FinishReason, PromptGroup, Sample
from asyncrlhf.sampling.version_wait import VersionWait, waits_for
from asyncrlhf.version import PolicyVersion

pytestmark = pytest.mark.unit
STOP = FinishReason.FINISH_REASON_STOP


def handed(*samples: tuple[list[int], int], lineage: int = 1) -> PromptGroup:
    """A group handed on under `lineage` with samples of these (token versions, finish reason)."""
    return PromptGroup(group_id="g", partial_lineage=lineage, partial_samples=[
        Sample(completion_token_ids=[7] * len(v), token_versions=v, finish_reason=finish)
        for v, finish in samples])


# an episode's transcript is a sample too: its environment tokens carry versions like the model's
UNFINISHED = ([3, 3, 4, 4], FinishReason.FINISH_REASON_UNSPECIFIED)
ENDED_NEWER = ([5, 5], STOP)  # ended: it gains no token, its versions bind nothing


@pytest.mark.parametrize(("served", "expected"), [
    (PolicyVersion(1, 3), 4),  # behind the newest unfinished token (4): wait for 4
    (PolicyVersion(1, 4), None),  # serves it: start now (the ended sample's 5 does not count)
    (PolicyVersion(1, 6), None),  # ahead: start now (versions go up, as they may)
    (PolicyVersion(2, 1), None),  # another lineage: the progress is dropped and sampled again, no wait
])
def test_a_group_waits_for_the_newest_version_of_its_unfinished_samples(served, expected):
    assert waits_for(handed(UNFINISHED, ENDED_NEWER), served) == expected


def test_a_group_with_no_unfinished_sample_never_waits():
    assert waits_for(handed(ENDED_NEWER), PolicyVersion(1, 1)) is None
    assert waits_for(PromptGroup(group_id="fresh"), PolicyVersion(1, 1)) is None


def test_waiting_groups_are_released_by_the_version_they_wait_for_and_all_taken_at_a_stop():
    wait: VersionWait[str] = VersionWait()
    wait.add("a", "item-a", handed(([2, 3], FinishReason.FINISH_REASON_UNSPECIFIED)), 3)
    wait.add("b", "item-b", handed(([2, 5], FinishReason.FINISH_REASON_UNSPECIFIED)), 5)
    assert wait.ready(PolicyVersion(1, 2)) == []
    assert [w.item for w in wait.ready(PolicyVersion(1, 4))] == ["item-a"]  # 4 >= 3, not yet 5
    assert "a" not in wait and "b" in wait
    assert [(w.item, w.version) for w in wait.take_all()] == [("item-b", 5)]
    assert wait.items() == []

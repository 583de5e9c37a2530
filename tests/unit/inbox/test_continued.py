"""What a trained step records of continued samples (the audit's count): per group that has any, the samples
continued from tokens sampled elsewhere and those tokens."""

import pytest

from asyncrlhf._proto.rollout_pb2 import RolloutGroup, Sample
from asyncrlhf.algorithms import StalenessDecision
from asyncrlhf.inbox.endings import continued_of
from asyncrlhf.inbox.strategy import StepBatch
from asyncrlhf.streams.consumer import Delivery

pytestmark = pytest.mark.unit


def delivery(gid, *carried):
    group = RolloutGroup(group_id=gid, samples=[Sample(continued_from=c) for c in carried])
    return Delivery(b"1-0", gid, group, 1)


def test_only_groups_with_continued_samples_are_recorded_with_their_samples_and_tokens():
    batch = StepBatch([delivery("g00000000", 0, 0), delivery("g00000001", 31, 0, 4)],
                      [StalenessDecision(0, "fresh")] * 2)
    assert continued_of(batch) == {"g00000001": [2, 35]}
    assert continued_of(StepBatch([delivery("g00000002", 0)], [StalenessDecision(0, "fresh")])) == {}

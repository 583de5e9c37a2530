"""The ranks' copy of a step's groups keeps each staleness decision whole, its per-token part included
(`StalenessDecision.fresh_from`): run as rank 0 of a world of one, where the broadcasts are no-ops and rank 0
decodes what it encoded, as every other rank does."""

from __future__ import annotations

import pytest

from asyncrlhf._proto.rollout_pb2 import PromptGroup, RolloutGroup, Sample
from asyncrlhf.algorithms import StalenessDecision
from asyncrlhf.training import engine
from asyncrlhf.training.batch import TrainGroup
from services.learner.broadcast import broadcast_groups

pytestmark = pytest.mark.unit


def test_decisions_travel_with_their_groups_per_token_part_included():
    engine.init_distributed()
    sample = Sample(completion_token_ids=[7, 8], logprobs=[-1.0, -1.0], reward=1.0, token_versions=[3, 5])
    prompt = PromptGroup(prompt_token_ids=[5], k=1)
    group = RolloutGroup(group_id="g00000000", prompt=prompt, policy_version=3, samples=[sample])
    sent = [TrainGroup(group, StalenessDecision(2, "correct", fresh_from=5)),
            TrainGroup(group, StalenessDecision(0, "fresh"))]
    received = broadcast_groups(sent, rank=0, world=2)  # world > 1: through the encoding
    assert received == sent
    assert broadcast_groups(None, rank=0, world=2) is None

"""An episode's environment reward is added to the scorers' total, as the component `env`; an episode task
may leave reward.scorers empty, a single-turn one may not."""

from __future__ import annotations

import pytest

from asyncrlhf._proto.rollout_pb2 import PromptGroup, RolloutGroup, Sample
from asyncrlhf.config import load_config
from asyncrlhf.rewards.base import ScoreResult
from asyncrlhf.rewards.groups import scored

pytestmark = pytest.mark.unit


def test_the_environment_reward_is_added_to_the_scorers_total():
    group = RolloutGroup(group_id="g", prompt=PromptGroup(group_id="g"),
                         samples=[Sample(env_reward=1.0), Sample(env_reward=0.0), Sample()])
    out = scored(group, ScoreResult([0.25, 0.5, 0.75], {"rule": [0.25, 0.5, 0.75]}), 0, "r")
    assert [s.reward for s in out.samples] == [1.25, 0.5, 0.75]
    assert [dict(s.reward_components) for s in out.samples] == [
        {"rule": 0.25, "env": 1.0}, {"rule": 0.5, "env": 0.0}, {"rule": 0.75}]


def test_only_an_episode_task_may_have_no_scorers():
    cfg = load_config(["configs/tools_calculator.yaml"])
    assert cfg.reward.scorers == [] and cfg.task.env.kind == "tools"
    with pytest.raises(ValueError, match="reward.scorers is empty"):
        load_config(["configs/tiny.yaml"], ["reward.scorers=[]"])
    with pytest.raises(ValueError, match="needs task.env.tools or task.env.mcp"):
        load_config(["configs/tiny.yaml"], ["task.env.kind=tools"])

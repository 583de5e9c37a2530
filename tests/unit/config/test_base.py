"""`Tagged`: pydantic itself (without the key walker) validates a union by its tag, with a default tag."""

import pytest
from pydantic import ValidationError

from asyncrlhf.config import Config, OnlineDPOLearnerConfig, PPOLearnerConfig, RuleScorerConfig

pytestmark = pytest.mark.unit


def test_pydantic_picks_the_member_by_the_tag_and_defaults_it():
    assert type(Config.model_validate({"learner": {"algorithm": "ppo"}}).learner) is PPOLearnerConfig
    assert type(Config.model_validate({"learner": {"lr": 1e-5}}).learner) is OnlineDPOLearnerConfig
    assert Config(learner=PPOLearnerConfig(lr=1e-5)).learner.lr == 1e-5
    assert Config.model_validate({"evaluator": {"gold": {"kind": "rule", "name": "x"}}}).evaluator.gold == (
        RuleScorerConfig(name="x")
    )


def test_pydantic_rejects_an_unknown_tag_and_a_foreign_field():
    with pytest.raises(ValidationError, match="`algorithm` must be one of online_dpo, ppo, rloo"):
        Config.model_validate({"learner": {"algorithm": "sac"}})
    with pytest.raises(ValidationError, match="`kind` must be one of rule, model, remote"):
        Config.model_validate({"reward": {"scorers": [{"name": "x"}]}})
    with pytest.raises(ValidationError, match="Extra inputs are not permitted"):
        Config.model_validate({"learner": {"algorithm": "ppo", "online_dpo": {}}})

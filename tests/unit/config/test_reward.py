"""Scorers (`reward.scorers[]`, `evaluator.gold`) are a union on `kind`: each kind takes its own fields, and a
field of another kind, or a missing one, fails naming it."""

import pytest

from asyncrlhf.config import ConfigError, ModelScorerConfig, RemoteScorerConfig, RuleScorerConfig, load_config

pytestmark = pytest.mark.unit


def test_the_kind_picks_the_scorer():
    cfg = load_config([], [
        "reward.scorers=[{kind: rule, name: length_penalty, args: {coef: 0.1}}, {kind: model, path: tiny, "
        "weight: 0.5}, {kind: remote, url: 'http://rm:5000'}]",
        "evaluator.gold={kind: model, path: runs/x/rm}",
    ])
    rule, model, remote = cfg.reward.scorers
    assert rule == RuleScorerConfig(name="length_penalty", args={"coef": 0.1})
    assert model == ModelScorerConfig(path="tiny", weight=0.5)
    assert remote == RemoteScorerConfig(url="http://rm:5000")
    assert cfg.evaluator.gold == ModelScorerConfig(path="runs/x/rm")
    defaults = load_config()
    assert defaults.reward.scorers == [RuleScorerConfig(name="sentiment")] == [defaults.evaluator.gold]


@pytest.mark.parametrize(
    "override, fragment",
    [
        ("reward.scorers=[{kind: rule, name: sentiment, url: 'http://x'}]",
         "`reward.scorers[0].url` belongs to `kind: remote`, but `reward.scorers[0].kind` is `rule`"),
        ("reward.scorers=[{kind: rule, name: sentiment}, {kind: model, path: tiny, name: rm}]",
         "`reward.scorers[1].name` belongs to `kind: rule`, but `reward.scorers[1].kind` is `model`"),
        ("reward.scorers=[{kind: remote, url: 'http://x', args: {token: t}}]",
         "`reward.scorers[0].args` belongs to `kind: rule`"),
        ("reward.scorers=[{kind: model, path: tiny, url: 'http://x'}]",
         "`reward.scorers[0].url` belongs to `kind: remote`"),
        ("evaluator.gold={kind: rule, name: sentiment, path: rm}",
         "`evaluator.gold.path` belongs to `kind: model`, but `evaluator.gold.kind` is `rule`"),
        ("reward.scorers=[{kind: rule, nmae: sentiment}]", "did you mean `reward.scorers[0].name`?"),
    ],
)
def test_a_field_of_another_kind_fails_naming_it(override, fragment):
    with pytest.raises(ConfigError) as err:
        load_config([], [override])
    assert fragment in str(err.value)


@pytest.mark.parametrize(
    "override, fragment",
    [
        ("reward.scorers=[{kind: rule}]", "`reward.scorers[0].name`: Field required: A shipped rule's name"),
        ("reward.scorers=[{kind: model}]", "`reward.scorers[0].path`: Field required"),
        ("reward.scorers=[{kind: remote}]", "`reward.scorers[0].url`: Field required"),
        ("evaluator.gold={kind: remote}", "`evaluator.gold.url`: Field required"),
        ("reward.scorers=[{kind: rule, name: ''}]", "`reward.scorers[0].name`"),
        ("reward.scorers=[{name: sentiment}]",
         "`reward.scorers[0].kind` is missing; write one of rule, model, remote"),
        ("evaluator.gold={kind: reward_model, path: x}",
         "`evaluator.gold.kind` is 'reward_model'; write one of"),
    ],
)
def test_a_scorer_missing_its_kind_or_target_fails_naming_it(override, fragment):
    with pytest.raises(ConfigError) as err:
        load_config([], [override])
    assert fragment in str(err.value)

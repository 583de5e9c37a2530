import pytest

from asyncrlhf.config import RewardConfig, RuleScorerConfig, load_config
from asyncrlhf.rewards import (
    CompositeReward,
    Item,
    ScoreResult,
    WeightedScorer,
    build_reward,
)

pytestmark = pytest.mark.unit


class Fixed:
    """A scorer returning fixed scores (and a component), to check the arithmetic of composition."""

    def __init__(self, scores, components=None):
        self.scores, self.components = scores, components or {}

    def score(self, prompts, completions, labels=None):
        return ScoreResult(list(self.scores), dict(self.components))


def items(n, ended=True, tokens=None):
    return [Item("p", "c", ended, tokens) for _ in range(n)]


def test_weighted_sum_and_components():
    reward = CompositeReward(
        [
            WeightedScorer("a", 2.0, Fixed([1.0, -0.5], {"sub": [3.0, 4.0]})),
            WeightedScorer("b", -0.5, Fixed([4.0, 2.0])),
        ]
    )
    result = reward.score(items(2))
    # item 0: 2.0 * 1.0 + (-0.5) * 4.0 = 0.0;  item 1: 2.0 * -0.5 + (-0.5) * 2.0 = -2.0
    assert result.scores == [0.0, -2.0]
    assert result.components == {"a": [1.0, -0.5], "a.sub": [3.0, 4.0], "b": [4.0, 2.0]}


def test_missing_eos_penalty_replaces_the_sum():
    reward = CompositeReward([WeightedScorer("a", 1.0, Fixed([0.7, 0.7, 0.7]))], missing_eos_penalty=-1.5)
    result = reward.score([Item("p", "c", True), Item("p", "c", False), Item("p", "c", True)])
    assert result.scores == pytest.approx([0.7, -1.5, 0.7])
    assert result.components["missing_eos"] == [0.0, 1.0, 0.0]


def test_length_limit_counts_as_missing_eos():
    reward = CompositeReward(
        [WeightedScorer("a", 1.0, Fixed([0.25, 0.25, 0.25]))],
        missing_eos_penalty=-1.0,
        max_completion_tokens=8,
    )
    result = reward.score([Item("p", "c", True, 8), Item("p", "c", True, 9), Item("p", "c", True, None)])
    # 8 tokens is within the limit; 9 is over; unknown length is not judged
    assert result.scores == [0.25, -1.0, 0.25]


def test_penalty_off_leaves_scores_and_adds_no_component():
    reward = CompositeReward([WeightedScorer("a", 1.0, Fixed([0.5]))], missing_eos_penalty=None)
    result = reward.score(items(1, ended=False))
    assert result.scores == [0.5] and "missing_eos" not in result.components


def test_build_reward_from_config_labels_each_scorer(tmp_path):
    (tmp_path / "mine.py").write_text("def score_fn(p, c):\n    return [1.0] * len(c)\n")
    cfg = RewardConfig(
        scorers=[
            RuleScorerConfig(name="sentiment", weight=1.0),
            RuleScorerConfig(name="length_penalty", weight=2.0, args={"target": 1, "coef": 0.1}),
            RuleScorerConfig(name="length_penalty", weight=1.0, args={"target": 0, "coef": 1.0}),
            RuleScorerConfig(name=f"{tmp_path}/mine.py:score_fn", weight=0.5),
        ],
        missing_eos_penalty=-1.0,
    )
    reward = build_reward(cfg)
    result = reward.score([Item("p", "the table stands", True)])
    # sentiment 0.0; length_penalty: -0.1 * (3 - 1) = -0.2, weighted x2 = -0.4;
    # length_penalty_2: -1.0 * 3 = -3.0; score_fn: 1.0 x 0.5 = 0.5;  total = -0.4 - 3.0 + 0.5 = -2.9
    assert result.scores == pytest.approx([-2.9])
    assert set(result.components) == {
        "sentiment",
        "length_penalty",
        "length_penalty_2",
        "score_fn",
        "missing_eos",
    }


def test_a_reward_without_scorers_fails_clearly():
    # a scorer missing its target (rule name, model path, remote url) fails earlier, at config load:
    # tests/unit/config/test_reward.py. No scorers at all is refused at config load too, unless the task is
    # an episode task (task.env), whose environment gives the reward: tests/unit/rewards/test_env_reward.py
    with pytest.raises(ValueError, match="reward.scorers is empty"):
        load_config(["configs/tiny.yaml"], ["reward.scorers=[]"])
    assert build_reward(RewardConfig(scorers=[])).score([]).scores == []

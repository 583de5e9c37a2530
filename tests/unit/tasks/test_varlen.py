"""Task `varlen`: prompts built in code that ask for every length band, a held-out split that is disjoint
and stable, and `configs/varlen.yaml` loading with its reward and gold."""

import pytest

from asyncrlhf.config import load_config
from asyncrlhf.rewards import Item, build_reward
from asyncrlhf.tasks import load_task, varlen

pytestmark = pytest.mark.unit


def test_config_loads_with_the_task_the_length_band_reward_and_a_strict_gold():
    cfg = load_config(["configs/varlen.yaml"], [])
    assert cfg.task.name == "varlen" and cfg.model.name_or_path == "smollm2-135m-instruct"
    assert cfg.generator.sampling.max_new_tokens == cfg.evaluator.max_new_tokens == 192
    assert [s.name for s in cfg.reward.scorers] == ["length_band", "sentiment"]
    assert cfg.evaluator.gold.name == "length_band" and cfg.evaluator.gold.args == {"strict": True}
    reward = build_reward(cfg.reward)
    one, neutral = "In one sentence, what is tea?", "Tea is a drink made from leaves."  # 7 words, VADER 0
    result = reward.score([Item(one, neutral), Item(one, neutral, ended_with_eos=False)])
    # in band: 1.0 * 1.0 + 0.25 * 0.0 = 1.0; no EOS: the penalty, -1.0
    assert result.scores == [1.0, -1.0]
    assert result.components["sentiment"] == [0.0, 0.0]


def test_every_prompt_asks_for_one_band_and_both_splits_hold_every_band():
    task = load_task(load_config(["configs/varlen.yaml"], []).task)
    assert len(task.train) + len(task.eval) == len(varlen.TEMPLATES) * len(varlen.TOPICS)
    assert not set(task.train) & set(task.eval)
    assert 0.15 < len(task.eval) / (len(task.train) + len(task.eval)) < 0.25  # the hash keeps ~20%
    for split in (task.train, task.eval):
        bands = [varlen.band_of(p) for p in split]
        assert None not in bands
        assert set(bands) == set(varlen.BANDS)
    for prompt in varlen.prompts():  # a phrase names one band: none is inside another's prompt
        assert sum(b.phrase in prompt.lower() for b in varlen.BANDS) == 1


def test_held_out_split_is_pinned_and_bands_read_back_from_the_prompt():
    # the held-out prompts are what gold rewards are compared on across runs: a change of templates, topics
    # or hash shows here
    assert varlen.eval_prompts()[:3] == [
        "Describe photosynthesis in two or three sentences.",
        "Explain photosynthesis in one paragraph.",
        "Explain photosynthesis in detail, covering how it works, its history and why it matters.",
    ]
    assert varlen.band_of("IN ONE SENTENCE, what is tea?") is varlen.ONE_SENTENCE
    assert varlen.band_of("What is tea?") is None

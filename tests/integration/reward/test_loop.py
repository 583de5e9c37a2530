"""The consumer loop against a real Redis: scoring through the streams, penalties, failures, de-dup."""

import time

import pytest
import torch

from asyncrlhf.config import ModelScorerConfig, RedisConfig, RewardConfig, RuleScorerConfig
from asyncrlhf.models import build_tiny_tokenizer, load_score_model
from asyncrlhf.rewards import build_reward
from asyncrlhf.streams import REWARD_GROUP, ROLLOUTS, SCORED, RunStreams
from services.reward.loop import RewardLoop
from services.reward.metrics import RewardMetrics
from tests.integration.reward.helpers import COMPLETIONS, rollout, scored_groups

pytestmark = pytest.mark.integration

FAST = RedisConfig(claim_idle_ms=200, block_ms=50, max_deliveries=2)


def make_loop(client, run, reward_cfg, consumer="r0", read_groups=4):
    streams = RunStreams(client, run, FAST)
    metrics = RewardMetrics()
    loop = RewardLoop(
        build_reward(reward_cfg),
        streams.consumer(ROLLOUTS, REWARD_GROUP, consumer),
        streams.producer(SCORED),
        metrics,
        scorer_id=consumer,
        retries=reward_cfg.retries,
        read_groups=read_groups,
    )
    return streams, loop, metrics


def run_until(loop, condition, timeout_s=20.0):
    deadline = time.monotonic() + timeout_s
    while not condition():
        assert time.monotonic() < deadline, "timed out running the reward loop"
        loop.step(block_ms=50)


def test_tiny_reward_model_through_redis_equals_a_direct_forward_pass(redis_client, run_name):
    cfg = RewardConfig(
        scorers=[ModelScorerConfig(path="tiny")], missing_eos_penalty=None, device="cpu"
    )
    streams, loop, metrics = make_loop(redis_client, run_name, cfg)
    groups = [
        rollout(f"g{i}", prompt=f"Prompt {i}:", texts=COMPLETIONS[i % 2 : i % 2 + 3], stopped=(True,) * 3)
        for i in range(5)
    ]
    streams.producer(ROLLOUTS).add_many(groups)
    run_until(loop, lambda: len(scored_groups(streams)) == 5)

    model, tokenizer = load_score_model("tiny").eval(), build_tiny_tokenizer()
    by_id = {g.group_id: g for g in scored_groups(streams)}
    assert set(by_id) == {g.group_id for g in groups}
    for sent in groups:
        got = by_id[sent.group_id]
        assert got.scorer_id == "r0" and got.scored_at > 0 and got.policy_version == 3
        for sample_in, sample_out in zip(sent.samples, got.samples, strict=True):
            ids = tokenizer(sent.prompt.prompt + sample_in.text)["input_ids"]
            with torch.no_grad():
                expected = model(input_ids=torch.tensor([ids])).logits[0, 0].item()
            assert sample_out.reward == pytest.approx(expected, abs=1e-5)
            assert dict(sample_out.reward_components) == pytest.approx({"model": expected}, abs=1e-5)
            assert list(sample_out.completion_token_ids) == list(sample_in.completion_token_ids)
    assert metrics.groups._value.get() == 5
    assert metrics.samples.labels("stream")._value.get() == 15
    assert streams.stats(ROLLOUTS, REWARD_GROUP).pending == 0


def test_sentiment_with_missing_eos_penalty_and_weights(redis_client, run_name):
    from vaderSentiment.vaderSentiment import SentimentIntensityAnalyzer

    cfg = RewardConfig(
        scorers=[RuleScorerConfig(name="sentiment", weight=2.0)], missing_eos_penalty=-3.0
    )
    streams, loop, _ = make_loop(redis_client, run_name, cfg)
    streams.producer(ROLLOUTS).add(rollout("g0", texts=COMPLETIONS[:2], stopped=(True, False)))
    run_until(loop, lambda: len(scored_groups(streams)) == 1)
    (group,) = scored_groups(streams)
    vader = SentimentIntensityAnalyzer().polarity_scores(COMPLETIONS[0])["compound"]
    # sample 0 stopped on EOS: 2 x compound; sample 1 hit the length limit: the penalty replaces it
    assert group.samples[0].reward == pytest.approx(2 * vader, abs=1e-6)
    assert group.samples[1].reward == pytest.approx(-3.0)
    assert group.samples[1].reward_components["missing_eos"] == 1.0
    assert group.samples[0].reward_components["missing_eos"] == 0.0


def test_a_failing_group_is_dead_lettered_with_the_reason_and_later_groups_still_score(
    redis_client, run_name, tmp_path
):
    (tmp_path / "picky.py").write_text(
        "calls = []\n"
        "def picky(prompts, completions):\n"
        "    calls.append(len(completions))\n"
        "    if any('POISON' in c for c in completions):\n"
        "        raise ValueError('cannot score POISON')\n"
        "    return [1.0] * len(completions)\n"
    )
    cfg = RewardConfig(scorers=[RuleScorerConfig(name=f"{tmp_path}/picky.py:picky")], retries=1)
    streams, loop, metrics = make_loop(redis_client, run_name, cfg, read_groups=3)
    rollouts = streams.producer(ROLLOUTS)
    rollouts.add_many([rollout("ok-0"), rollout("bad", texts=[" POISON", " fine"]), rollout("ok-1")])
    run_until(loop, lambda: len(scored_groups(streams)) == 2)
    rollouts.add_many([rollout("ok-2"), rollout("ok-3")])  # arrive after the failure
    run_until(loop, lambda: len(streams.dead_letters()) == 1 and len(scored_groups(streams)) == 4)

    (dead,) = streams.dead_letters()
    assert dead.identity == "bad" and dead.stream == ROLLOUTS.name
    assert "ValueError: cannot score POISON" in dead.reason and dead.deliveries == FAST.max_deliveries
    assert sorted(g.group_id for g in scored_groups(streams)) == ["ok-0", "ok-1", "ok-2", "ok-3"]
    assert metrics.dead_lettered._value.get() == 1
    # every delivery of `bad` is tried 1 + retries times (plus the batch it first came in): errors counted
    assert metrics.errors._value.get() >= FAST.max_deliveries * (1 + cfg.retries)
    time.sleep(FAST.claim_idle_ms / 1000 * 2)
    loop.step(block_ms=50)
    assert streams.stats(ROLLOUTS, REWARD_GROUP).pending == 0 and len(scored_groups(streams)) == 4


def test_a_group_enqueued_twice_is_scored_once(redis_client, run_name):
    cfg = RewardConfig(scorers=[RuleScorerConfig(name="sentiment")])
    streams, loop, metrics = make_loop(redis_client, run_name, cfg, read_groups=1)
    streams.producer(ROLLOUTS).add_many([rollout("g0"), rollout("g1"), rollout("g0")])
    run_until(
        loop, lambda: len(scored_groups(streams)) >= 2 and streams.stats(ROLLOUTS, REWARD_GROUP).length == 0
    )
    assert sorted(g.group_id for g in scored_groups(streams)) == ["g0", "g1"]
    assert metrics.groups._value.get() == 2 and metrics.duplicates._value.get() == 1

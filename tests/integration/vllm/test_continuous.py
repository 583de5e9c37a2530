"""Continuous generation on a real vLLM engine (its CPU build here), driven step by step: a push between two
steps changes the version of the tokens after it and only those (with the KV cache kept, and recomputed),
the API's requests share the loop's steps, and a stopped generator's samples are finished by another with
their earlier tokens unchanged (handed on at a stop; continued from the last save after a kill), only once
that generator serves the newest version they were sampled by."""

from __future__ import annotations

import threading
import time

import pytest
import torch

from asyncrlhf._proto.rollout_pb2 import PromptGroup
from asyncrlhf.config import SamplingConfig
from asyncrlhf.models import encode_prompts, load_policy, load_tokenizer
from asyncrlhf.sampling.continuous import ContinuousSampler, GroupPrompt
from asyncrlhf.sampling.single_turn import Completions, Progress
from asyncrlhf.sampling.vllm_stepping import VLLMStepEngine
from asyncrlhf.serving.gate import BackendGate
from asyncrlhf.streams import GENERATOR_GROUP, PROMPTS, ROLLOUTS, RunStreams
from asyncrlhf.token_versions import token_versions_problem
from asyncrlhf.version import PolicyVersion
from services.generator.continuous import ContinuousLoop
from services.generator.loop import LoopContext, PromptIO
from services.generator.metrics import GeneratorMetrics
from services.generator.samples import SingleTurn
from services.generator.server import WeightSwap
from tests.integration.vllm.helpers import PARITY_ATOL, reference_logprobs, vllm_config
from tests.unit.generator.peaked import perturbed_state_dict

pytestmark = [pytest.mark.integration, pytest.mark.vllm]

LONG = SamplingConfig(temperature=1.0, max_new_tokens=48)
PUSH_AFTER_STEPS = 6


@pytest.fixture(scope="module")
def engine(tmp_path_factory):
    from asyncrlhf.sampling.vllm import VLLMBackend

    cfg = vllm_config(tmp_path_factory.mktemp("vllm-cache"), "generator.mode=continuous",
                      "generator.samples_per_prompt=2", "generator.batch_prompts=2",
                      f"generator.sampling.max_new_tokens={LONG.max_new_tokens}")
    tokenizer = load_tokenizer(cfg.model)
    backend = VLLMBackend.from_config(cfg, tokenizer)
    driver = VLLMStepEngine(backend)
    backend.driver = driver
    prompts = encode_prompts(tokenizer, ["hello", "a longer prompt than that"], cfg.model)
    yield cfg, tokenizer, backend, driver, prompts
    backend.close()


def push(backend, weights, step: int, lineage: int = 1) -> None:
    backend.apply_weights(weights, PolicyVersion(lineage, step))


@pytest.mark.parametrize("recompute", [False, True], ids=["keep-kv", "recompute-kv"])
def test_a_push_mid_sequence_changes_the_versions_of_the_tokens_after_it_and_only_those(engine, recompute):
    cfg, _, backend, driver, prompts = engine
    policy = load_policy(cfg.model).eval()
    old = perturbed_state_dict(policy, seed=21, scale=0.2)
    new = perturbed_state_dict(policy, seed=22, scale=0.2)
    push(backend, old, 1)
    backend.recompute_inflight = recompute
    sampler: ContinuousSampler[str, Progress] = ContinuousSampler(driver, Completions(), LONG)
    runs = [sampler.start(f"t{i}", f"g{i}-{recompute}", GroupPrompt(p), 2, lineage=1)
            for i, p in enumerate(prompts)]
    for _ in range(PUSH_AFTER_STEPS):
        sampler.step(1)
    before = [[list(s.token_ids) for s in run.samples] for run in runs]
    push(backend, new, 2)
    while sampler.running_samples:
        sampler.step(2)
    policy.load_state_dict(new)
    checked = 0
    for run, earlier in zip(runs, before, strict=True):
        for sample, prefix in zip(run.samples, earlier, strict=True):
            n = len(prefix)
            assert sample.token_ids[:n] == prefix  # what was sampled before the push stays as it was
            assert sample.versions == [1] * n + [2] * (len(sample.token_ids) - n)
            if len(sample.token_ids) == n:
                continue
            checked += 1
            # the tokens after the push were drawn from the new weights: exactly their log-probs when the KV
            # cache was recomputed; with the old weights' KV kept for the prefix, close to them but not equal
            expected = reference_logprobs(policy, run.prompt.ids + sample.token_ids[:n], sample.token_ids[n:],
                                          LONG)
            gap = (torch.tensor(sample.logprobs[n:]) - expected).abs().max().item()
            if recompute:
                assert gap <= PARITY_ATOL
            else:
                assert gap > PARITY_ATOL
    assert checked, "no sample outlived the push: lengthen LONG"


def test_the_api_is_answered_from_the_loops_steps_while_it_samples(engine):
    cfg, _, backend, driver, prompts = engine
    push(backend, perturbed_state_dict(load_policy(cfg.model), seed=23, scale=0.2), 3)
    sampler: ContinuousSampler[str, Progress] = ContinuousSampler(driver, Completions(), LONG)
    sampler.start("t", "api-beside", GroupPrompt(prompts[1]), 2, lineage=1)
    answers: list = []
    api = threading.Thread(target=lambda: answers.append(
        backend.generate([prompts[0]], 3, SamplingConfig(max_new_tokens=4))))
    api.start()
    steps = 0
    while api.is_alive() and steps < 500:
        sampler.step(3)
        steps += 1
    api.join(5)
    assert answers and len(answers[0][0]) == 3 and all(len(c.token_ids) <= 4 for c in answers[0][0])
    assert sampler.running_samples > 0 or steps < 48  # the loop's group was running beside the API's
    while sampler.running_samples:
        sampler.step(3)


class _Generator:
    """A continuous loop as a generator process runs it (its own consumer id), over the shared engine."""

    def __init__(self, cfg, backend, driver, tokenizer, client, name: str, version: PolicyVersion):
        streams = RunStreams(client, cfg.run.name, cfg.redis)
        metrics = GeneratorMetrics(name)
        self.swap = WeightSwap(backend, BackendGate(), metrics, engine=driver)  # swaps: on the loop thread
        self.swap.served = version
        io = PromptIO(streams.consumer(PROMPTS, GENERATOR_GROUP, name), streams.producer(ROLLOUTS),
                      handon=streams.producer(PROMPTS), partials=streams.partials())
        ctx = LoopContext(cfg, self.swap, io, tokenizer, name)
        self.loop = ContinuousLoop(ctx, SingleTurn(ctx), driver)
        self.metrics = metrics


def _stream_groups(client, cfg, spec):
    from asyncrlhf.streams import PAYLOAD_FIELD, run_key

    return [spec.message_type.FromString(fields[PAYLOAD_FIELD])
            for _, fields in client.xrange(run_key(cfg.run.name, spec.name))]


def _run_until(gen: _Generator, done, limit_s: float = 120) -> None:
    deadline = time.monotonic() + limit_s
    while not done():
        assert time.monotonic() < deadline, "the continuous loop did not get there"
        gen.loop.step()


def _longest(gen: _Generator) -> int:
    """Tokens of the longest sample of the first group in flight (0: none in flight)."""
    groups = gen.loop.sampler.groups
    return max(len(s.token_ids) for s in groups[0].samples) if groups else 0


def _cfg_for(cfg, run_name, redis_url, *extra):
    from asyncrlhf.config import load_config

    return load_config(["configs/tiny.yaml"], [
        f"model.cache_dir={cfg.model.cache_dir}", "model.tiny.heads=2", "model.dtype=float32",
        "generator.backend=vllm", "generator.device=cpu", "generator.mode=continuous",
        "generator.samples_per_prompt=2", f"generator.sampling.max_new_tokens={LONG.max_new_tokens}",
        f"redis.url={redis_url}", f"run.name={run_name}", "redis.block_ms=50", *extra])


def test_a_stopped_generators_samples_are_finished_by_another_with_their_earlier_tokens_unchanged(
        engine, redis_client, redis_url, run_name):
    base, tokenizer, backend, driver, prompts = engine
    cfg = _cfg_for(base, run_name, redis_url)
    push(backend, perturbed_state_dict(load_policy(base.model), seed=24, scale=0.2), 4)
    version = PolicyVersion(1, 4)
    RunStreams(redis_client, cfg.run.name, cfg.redis).producer(PROMPTS).add(
        PromptGroup(group_id="g00000000", prompt_token_ids=prompts[1], k=2, enqueued_at=time.time()))
    a = _Generator(cfg, backend, driver, tokenizer, redis_client, "gen-a", version)
    _run_until(a, lambda: _longest(a) >= 5)
    run = a.loop.sampler.groups[0]
    earlier = [(list(s.token_ids), list(s.logprobs), list(s.versions)) for s in run.samples]
    assert a.loop.hand_on() == 1  # what SIGTERM does: the loop stops and hands its groups on

    (handed,) = _stream_groups(redis_client, cfg, PROMPTS)
    assert handed.handoffs == 1 and handed.partial_lineage == 1
    assert [list(s.completion_token_ids) for s in handed.partial_samples] == [e[0] for e in earlier]

    b = _Generator(cfg, backend, driver, tokenizer, redis_client, "gen-b", version)
    _run_until(b, lambda: _stream_groups(redis_client, cfg, ROLLOUTS))
    (rollout,) = _stream_groups(redis_client, cfg, ROLLOUTS)
    assert rollout.group_id == "g00000000"
    for sample, (ids, logps, versions) in zip(rollout.samples, earlier, strict=True):
        n = len(ids)
        unfinished = sample.continued_from > 0
        assert list(sample.completion_token_ids[:n]) == ids
        assert list(sample.logprobs[:n]) == pytest.approx(logps)
        assert list(sample.token_versions[:n]) == versions
        assert len(sample.completion_token_ids) <= LONG.max_new_tokens
        if unfinished:
            assert sample.continued_from == n
    assert b.metrics.continued_samples._value.get() >= 1
    assert not _stream_groups(redis_client, cfg, PROMPTS)


def test_a_killed_generator_loses_at_most_the_tokens_since_its_last_save(engine, redis_client, redis_url,
                                                                          run_name):
    base, tokenizer, backend, driver, prompts = engine
    save_every = 8
    cfg = _cfg_for(base, run_name, redis_url, f"generator.save_every_tokens={save_every}",
                   "redis.claim_idle_ms=200")
    push(backend, perturbed_state_dict(load_policy(base.model), seed=25, scale=0.2), 5)
    version = PolicyVersion(1, 5)
    RunStreams(redis_client, cfg.run.name, cfg.redis).producer(PROMPTS).add(
        PromptGroup(group_id="g00000001", prompt_token_ids=prompts[0], k=2, enqueued_at=time.time()))
    a = _Generator(cfg, backend, driver, tokenizer, redis_client, "gen-a", version)
    _run_until(a, lambda: _longest(a) >= 2 * save_every + 3)
    run = a.loop.sampler.groups[0]
    at_kill = [list(s.token_ids) for s in run.samples]
    driver.abort([key for key in list(a.loop.sampler._sequences)])  # SIGKILL: nothing handed on, no ack

    time.sleep(0.3)  # past claim_idle_ms: the entry is re-claimed from the dead consumer
    b = _Generator(cfg, backend, driver, tokenizer, redis_client, "gen-b", version)
    _run_until(b, lambda: _stream_groups(redis_client, cfg, ROLLOUTS))
    (rollout,) = _stream_groups(redis_client, cfg, ROLLOUTS)
    for sample, ids in zip(rollout.samples, at_kill, strict=True):
        if sample.continued_from == 0:  # ended before the last save: kept whole
            continue
        assert len(ids) - sample.continued_from <= save_every  # lost: the tokens since the last save
        assert list(sample.completion_token_ids[:sample.continued_from]) == ids[:sample.continued_from]


def test_a_group_handed_on_at_a_newer_version_waits_until_the_generator_serves_it(engine, redis_client,
                                                                                   redis_url, run_name):
    # Generator A serves version 8 and is stopped mid-group; generator B still serves 7 (its push is running,
    # or it is a relay leaf). B keeps the group pending, unstarted, until its push of 8 lands (from another
    # thread, as gRPC's: run by B's loop between two steps); then it continues it: the group's token versions
    # never go down, so the learner takes it, and nothing is dead-lettered. (The shared engine plays A's and
    # then B's: it is given B's weights before B steps.)
    base, tokenizer, backend, driver, prompts = engine
    cfg = _cfg_for(base, run_name, redis_url)
    policy = load_policy(base.model)
    weights = {v: perturbed_state_dict(policy, seed=20 + v, scale=0.2) for v in (7, 8)}
    streams = RunStreams(redis_client, cfg.run.name, cfg.redis)
    streams.producer(PROMPTS).add(PromptGroup(group_id="g00000002", prompt_token_ids=prompts[1], k=2,
                                              enqueued_at=time.time()))
    push(backend, weights[8], 8)
    a = _Generator(cfg, backend, driver, tokenizer, redis_client, "gen-a", PolicyVersion(1, 8))
    _run_until(a, lambda: _longest(a) >= 5)
    assert a.loop.hand_on() == 1

    push(backend, weights[7], 7)
    b = _Generator(cfg, backend, driver, tokenizer, redis_client, "gen-b", PolicyVersion(1, 7))
    for _ in range(30):
        b.loop.step()
    assert not b.loop.sampler.groups and not _stream_groups(redis_client, cfg, ROLLOUTS)  # waiting, not lost
    assert b.metrics.version_waits._value.get() == 1
    assert "g00000002" in b.loop.waiting

    pusher = threading.Thread(target=b.swap.apply_weights, args=(weights[8], PolicyVersion(1, 8)))
    pusher.start()
    _run_until(b, lambda: _stream_groups(redis_client, cfg, ROLLOUTS))
    pusher.join(10)
    (rollout,) = _stream_groups(redis_client, cfg, ROLLOUTS)
    assert token_versions_problem(rollout, PolicyVersion(1, 8)) is None
    assert all(list(s.token_versions) == [8] * len(s.token_versions) for s in rollout.samples)
    assert any(s.continued_from for s in rollout.samples)
    assert streams.dead_letters(count=None) == []

"""The generator as a process: real Redis, real gRPC pushes found through the registry, the tiny model."""

import threading
import uuid

import httpx
import pytest
import redis
import torch

from asyncrlhf import metrics as names
from asyncrlhf._proto.rollout_pb2 import FinishReason
from asyncrlhf.config import load_config
from asyncrlhf.models import encode_prompts, load_policy, load_tokenizer
from asyncrlhf.streams import run_key
from tests.integration.generator.helpers import (
    START_TIMEOUT_S,
    GeneratorProcess,
    enqueue,
    members,
    push,
    recomputed_logprobs,
    rollouts,
    rollouts_for,
    wait_for,
)
from tests.unit.generator.peaked import peaked_state_dict, perturbed_state_dict

pytestmark = pytest.mark.integration
LOGPROB_ATOL = 1e-4  # same fp32 weights; batched, padded, KV-cached vs one unpadded pass: ~1e-6 apart
CFG = load_config(["configs/tiny.yaml"])
TEMPERATURE = CFG.generator.sampling.temperature


class Running:
    """One generator process for this module, and the versions pushed to it so far."""

    def __init__(self, url: str):
        self.run = f"test-generator-{uuid.uuid4().hex[:8]}"
        self.client = redis.Redis.from_url(url)
        self.process = GeneratorProcess(url, self.run)
        self.tokenizer = load_tokenizer(CFG.model)
        self.base = load_policy(CFG.model).eval()
        self.pushed: dict[int, dict[str, torch.Tensor]] = {}
        (self.member,) = wait_for(lambda: members(self.client, self.run), "the generator to register",
                                  START_TIMEOUT_S, [self.process])

    def push(self, state: dict[str, torch.Tensor]) -> int:
        version = max(self.pushed, default=0) + 1
        push(state, version, [self.member])
        self.pushed[version] = state
        return version

    def model_at(self, version: int) -> torch.nn.Module:
        model = load_policy(CFG.model).eval()
        model.load_state_dict(self.pushed[version])
        return model

    def prompts(self, n: int) -> list[list[int]]:
        return encode_prompts(self.tokenizer, [f"prompt {i} " + "x" * (i % 5) for i in range(n)], CFG.model)

    def close(self) -> None:
        self.process.stop()
        keys = list(self.client.scan_iter(match=run_key(self.run, "*")))
        if keys:
            self.client.delete(*keys)
        self.client.close()


@pytest.fixture(scope="module")
def gen(redis_url):
    running = Running(redis_url)
    yield running
    running.close()


def test_registers_without_a_version_until_the_first_push(gen):
    if gen.pushed:
        pytest.skip("runs first: later tests have pushed")
    assert gen.member.version.step == 0
    version = gen.push(perturbed_state_dict(gen.base, seed=1))
    wait_for(lambda: members(gen.client, gen.run)[0].version.step == version,
             "the registry to show the new version")


def test_groups_have_k_samples_with_exact_logprobs_and_the_version_used(gen):
    version = gen.push(perturbed_state_dict(gen.base, seed=2))
    prompts = gen.prompts(6)
    ids = enqueue(gen.client, gen.run, prompts[:3], k=3) + enqueue(gen.client, gen.run, prompts[3:])
    found = wait_for(lambda: rollouts_for(gen.client, gen.run, ids), "6 rollout groups", alive=[gen.process])
    model = gen.model_at(version)
    for group_id, prompt, k in zip(ids, prompts, [3, 3, 3, 2, 2, 2], strict=True):
        group = found[group_id]
        assert group.policy_version == version and group.generator_id == gen.member.id
        assert list(group.prompt.prompt_token_ids) == prompt and len(group.samples) == k
        assert group.generation_started_at <= group.generated_at
        for sample in group.samples:
            tokens = list(sample.completion_token_ids)
            assert len(sample.logprobs) == len(tokens) > 0
            stopped = tokens[-1] == gen.tokenizer.eos_token_id
            assert sample.finish_reason == (FinishReason.FINISH_REASON_STOP if stopped
                                            else FinishReason.FINISH_REASON_LENGTH)
            assert gen.tokenizer.eos_token_id not in tokens[:-1]
            assert stopped or len(tokens) == CFG.generator.sampling.max_new_tokens
            assert sample.text == gen.tokenizer.decode(tokens, skip_special_tokens=True)
            expected = recomputed_logprobs(model, prompt, tokens, TEMPERATURE)
            torch.testing.assert_close(torch.tensor(list(sample.logprobs)), expected,
                                       atol=LOGPROB_ATOL, rtol=0)


def test_a_push_mid_run_tags_later_groups_and_changes_behaviour(gen):
    before = gen.push(perturbed_state_dict(gen.base, seed=3))
    first = enqueue(gen.client, gen.run, gen.prompts(12))
    wait_for(lambda: any(g.group_id in first for g in rollouts(gen.client, gen.run)), "the first batch",
             alive=[gen.process])
    a = gen.tokenizer("a", add_special_tokens=False)["input_ids"][0]
    after = gen.push(peaked_state_dict(gen.base, a))  # returns once the generator applied it
    second = enqueue(gen.client, gen.run, gen.prompts(4))
    found = wait_for(lambda: rollouts_for(gen.client, gen.run, first + second), "16 rollout groups",
                     alive=[gen.process])
    models = {before: gen.model_at(before), after: gen.model_at(after)}
    for group_id in first + second:
        group = found[group_id]
        assert group.policy_version in models
        if group_id in second:
            assert group.policy_version == after
        for sample in group.samples:  # every sample matches the weights its group names: no mid-group swap
            tokens = list(sample.completion_token_ids)
            if group.policy_version == after:
                assert tokens == [a] * CFG.generator.sampling.max_new_tokens
            expected = recomputed_logprobs(models[group.policy_version], list(group.prompt.prompt_token_ids),
                                           tokens, TEMPERATURE)
            torch.testing.assert_close(torch.tensor(list(sample.logprobs)), expected,
                                       atol=LOGPROB_ATOL, rtol=0)


def test_completions_endpoint_returns_text_and_the_version(gen):
    version = gen.push(perturbed_state_dict(gen.base, seed=4))
    with httpx.Client(base_url=gen.process.url, timeout=30) as http:
        wait_for(lambda: http.get("/readyz").status_code == 200, "/readyz", alive=[gen.process])
        reply = http.post("/v1/completions", json={"model": "tiny", "prompt": ["hello", "bye"], "n": 2,
                                                   "max_tokens": 5, "logprobs": 0})
        assert reply.status_code == 200, reply.text
        body = reply.json()
        assert body["policy_version"] == version and body["generator_id"] == gen.member.id
        assert [c["index"] for c in body["choices"]] == [0, 1, 2, 3]
        for choice in body["choices"]:
            ids = choice["logprobs"]["token_ids"]
            assert 0 < len(ids) <= 5 and choice["text"] == gen.tokenizer.decode(ids, skip_special_tokens=True)
        bad = http.post("/v1/completions", json={"model": "tiny", "prompt": "hi", "temperature": -1})
        assert bad.status_code == 400 and bad.json()["error"]["param"] == "temperature"
        metrics = http.get("/metrics").text
        gauge = f'{names.GENERATOR_POLICY_VERSION}{{generator="{gen.member.id}"}} {float(version)}'
        assert gauge in metrics
        assert names.GENERATOR_TOKENS_TOTAL in metrics


def test_a_busy_api_neither_starves_nor_corrupts_training(gen):
    """Clients flood the OpenAI API while the loop samples prompt groups and a push lands: every group
    arrives, every group and every API answer is sampled wholly by the version it names (log-probs
    recomputed under that version's weights)."""
    import openai

    before = gen.push(perturbed_state_dict(gen.base, seed=5))
    client = openai.OpenAI(base_url=f"{gen.process.url}/v1", api_key="unused", max_retries=0, timeout=120)
    wait_for(lambda: httpx.get(f"{gen.process.url}/readyz").status_code == 200, "/readyz",
             alive=[gen.process])
    stop, answers, failures = threading.Event(), [], []
    prompt = gen.tokenizer("api prompt")["input_ids"]

    def flood():
        while not stop.is_set():
            try:
                answers.append(client.completions.create(model="tiny", prompt=prompt, max_tokens=8, n=2,
                                                         logprobs=0))
            except openai.RateLimitError:
                continue  # refused while 8 API requests wait: the bound working, not a failure
            except Exception as err:  # reported below
                failures.append(err)
                return

    threads = [threading.Thread(target=flood) for _ in range(3)]
    for t in threads:
        t.start()
    try:
        first = enqueue(gen.client, gen.run, gen.prompts(8))
        wait_for(lambda: any(g.group_id in first for g in rollouts(gen.client, gen.run)), "a first group",
                 alive=[gen.process])
        after = gen.push(perturbed_state_dict(gen.base, seed=6))
        second = enqueue(gen.client, gen.run, gen.prompts(4))
        found = wait_for(lambda: rollouts_for(gen.client, gen.run, first + second), "12 rollout groups",
                         alive=[gen.process])
        wait_for(lambda: any(a.policy_version == after for a in answers),
                 "an API answer from the new version", alive=[gen.process])
    finally:
        stop.set()
        for t in threads:
            t.join(120)
    assert not failures, failures
    models = {v: gen.model_at(v) for v in (before, after)}
    for group_id in first + second:
        group = found[group_id]
        assert group.policy_version in models and (group_id in first or group.policy_version == after)
        for sample in group.samples:
            tokens = list(sample.completion_token_ids)
            expected = recomputed_logprobs(models[group.policy_version], list(group.prompt.prompt_token_ids),
                                           tokens, TEMPERATURE)
            torch.testing.assert_close(torch.tensor(list(sample.logprobs)), expected, atol=LOGPROB_ATOL,
                                       rtol=0)
    checked = [a for a in answers if a.policy_version in models]
    assert len(checked) >= 2
    for answer in checked:
        for choice in answer.choices:
            tokens = choice.logprobs.token_ids
            expected = recomputed_logprobs(models[answer.policy_version], prompt, tokens, 1.0)
            torch.testing.assert_close(torch.tensor(choice.logprobs.token_logprobs), expected,
                                       atol=LOGPROB_ATOL, rtol=0)

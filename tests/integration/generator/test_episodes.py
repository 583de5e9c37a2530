"""Episodes in the generator process (task.env), on real Redis with a real push: every group is written
with its episodes' loss masks and ends; an environment that raises, hangs or answers garbage ends only its
own episodes, the generator keeps going, and its metrics count each end and the steps."""

from __future__ import annotations

import time
import uuid

import httpx
import pytest
import redis

from asyncrlhf._proto.rollout_pb2 import PromptGroup
from asyncrlhf.config import load_config
from asyncrlhf.models import load_policy
from asyncrlhf.streams import PROMPTS, RunStreams, run_key
from tests.integration.generator.helpers import (
    START_TIMEOUT_S,
    GeneratorProcess,
    members,
    push,
    rollouts_for,
    wait_for,
)

pytestmark = pytest.mark.integration
ENV = ["task.env.kind=class", "task.env.path=tests/unit/envs/scripted.py:Picky", "task.env.max_turns=4",
       "task.env.step_timeout_s=2", "task.env.max_episode_tokens=200", "model.max_prompt_tokens=128",
       "generator.sampling.max_new_tokens=6", "generator.batch_prompts=4"]


def test_episodes_are_written_and_a_failing_environment_ends_only_its_own(redis_url):
    run = f"test-episodes-{uuid.uuid4().hex[:8]}"
    client = redis.Redis.from_url(redis_url)
    process = GeneratorProcess(redis_url, run, *ENV)
    try:
        (member,) = wait_for(lambda: members(client, run), "the generator to register", START_TIMEOUT_S,
                             [process])
        push(load_policy(load_config(["configs/tiny.yaml"]).model).state_dict(), 1, [member])
        texts = ["count please", "boom now", "hang on", "junk out"]
        groups = [PromptGroup(group_id=f"g-{i}", prompt=t, prompt_token_ids=[5, 6], k=3 if i == 0 else 2,
                              enqueued_at=time.time()) for i, t in enumerate(texts)]
        RunStreams(client, run).producer(PROMPTS).add_many(groups)
        found = wait_for(lambda: rollouts_for(client, run, [g.group_id for g in groups]), "4 groups",
                         alive=[process])
        ends = {g.prompt.prompt: [s.episode_end for s in g.samples] for g in found.values()}
        assert ends["count please"] == ["done", "done", "done"]  # a group's own k
        assert all(e.startswith("error: step raised RuntimeError: boom") for e in ends["boom now"])
        assert all(e.startswith("timeout: step ran past") for e in ends["hang on"])
        assert all(e.startswith("malformed: step returned str") for e in ends["junk out"])
        for group in found.values():
            assert group.policy_version == 1 and len(group.samples) == group.prompt.k
            assert list(group.prompt.prompt_token_ids) != [5, 6]  # the episode's own first context
            for s in group.samples:
                assert len(s.loss_mask) == len(s.completion_token_ids) == len(s.logprobs)
                assert s.HasField("env_reward") and s.turns >= 1
        good = found["g-0"].samples[0]
        assert good.turns == 3 and good.env_reward == 1.0 and 0 < sum(good.loss_mask) < len(good.loss_mask)
        metrics = httpx.get(f"{process.url}/metrics").text
        assert 'asyncrlhf_generator_episodes_total{end="timeout"} 2.0' in metrics
        assert 'asyncrlhf_generator_episodes_total{end="done"} 3.0' in metrics
        assert "asyncrlhf_generator_env_step_seconds_count" in metrics
        process.check_alive()
    finally:
        process.stop()
        keys = list(client.scan_iter(match=run_key(run, "*")))
        if keys:
            client.delete(*keys)
        client.close()

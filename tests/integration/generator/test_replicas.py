"""Two generator processes share one prompts stream: each prompt is generated exactly once."""

import re

import httpx
import pytest

from asyncrlhf import metrics as names
from asyncrlhf.config import load_config
from asyncrlhf.models import encode_prompts, load_policy, load_tokenizer
from asyncrlhf.streams import GENERATOR_GROUP, PROMPTS, RunStreams
from tests.integration.generator.helpers import (
    START_TIMEOUT_S,
    GeneratorProcess,
    enqueue,
    members,
    push,
    rollouts,
    rollouts_for,
    wait_for,
)
from tests.unit.generator.peaked import perturbed_state_dict

pytestmark = pytest.mark.integration
N_PROMPTS = 24


def idle_seconds(url: str) -> float:
    """0 until the generator's HTTP server answers (it registers in Redis first, then serves HTTP)."""
    try:
        text = httpx.get(f"{url}/metrics", timeout=10).text
    except httpx.ConnectError:
        return 0.0
    match = re.search(rf"^{names.GENERATOR_IDLE_SECONDS_TOTAL} ([0-9.e+-]+)$", text, re.M)
    return float(match.group(1)) if match else 0.0


def test_two_generators_share_the_prompts_without_duplicates_or_gaps(redis_url, run_name, redis_client):
    cfg = load_config(["configs/tiny.yaml"])
    procs = [GeneratorProcess(redis_url, run_name) for _ in range(2)]
    try:
        live = wait_for(lambda: len(members(redis_client, run_name)) == 2 and members(redis_client, run_name),
                        "both generators to register", START_TIMEOUT_S, procs)
        assert [m.version.step for m in live] == [0, 0]
        prompts = encode_prompts(load_tokenizer(cfg.model), [f"p{i}" for i in range(N_PROMPTS)], cfg.model)
        ids = enqueue(redis_client, run_name, prompts)

        # Without weights neither generator reads: idle time grows, the prompts stay undelivered.
        wait_for(lambda: all(idle_seconds(p.url) > 1.0 for p in procs), "both generators to idle a second",
                 alive=procs)
        stats = RunStreams(redis_client, run_name).stats(PROMPTS, GENERATOR_GROUP)
        assert (stats.length, stats.pending) == (N_PROMPTS, 0) and rollouts(redis_client, run_name) == []

        push(perturbed_state_dict(load_policy(cfg.model), seed=5), 1, live)
        wait_for(lambda: rollouts_for(redis_client, run_name, ids), f"{N_PROMPTS} rollout groups",
                 alive=procs)
        written = rollouts(redis_client, run_name)
        assert sorted(g.group_id for g in written) == sorted(ids)  # none twice, none missed
        assert {g.generator_id for g in written} == {m.id for m in live}  # both did some of the work
        assert all(g.policy_version == 1 for g in written)
        stats = RunStreams(redis_client, run_name).stats(PROMPTS, GENERATOR_GROUP)
        assert (stats.length, stats.pending) == (0, 0)

        procs[0].stop()  # SIGTERM: finish the batch, leave the registry, exit cleanly
        assert procs[0].proc.returncode == 0
        assert len(members(redis_client, run_name)) == 1
    finally:
        for p in procs:
            p.stop()

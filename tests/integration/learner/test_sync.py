"""The learner's weight publisher against real WeightSync receivers (real gRPC, real Redis registry): a
permanent refusal fails the learner at once with the receiver's reason; transient failures are retried up
to `learner.push_max_failures` in a row; with relays every live generator still serves each version; with
delta pushes a generator that kept the last version gets only what changed, a late one the version whole."""

import time
from types import SimpleNamespace

import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM

from asyncrlhf.config import load_config
from asyncrlhf.metrics import (
    LEARNER_PUSH_BYTES_TOTAL,
    LEARNER_PUSHED_BYTES_TOTAL,
    LEARNER_PUSHED_VERSIONS_TOTAL,
    LEARNER_PUSHES_TOTAL,
)
from asyncrlhf.redis_server import free_port
from asyncrlhf.registry import Registry
from asyncrlhf.version import PolicyVersion
from asyncrlhf.weights.pusher import WeightPusher
from asyncrlhf.weights.vocabulary import Route
from services.learner.metrics import LearnerMetrics
from services.learner.sync import PushFailed, WeightPublisher
from tests.integration.weights.helpers import TOKEN, Generator, same, snapshot, tiny_model
from tests.integration.weights.test_delta import pushed, train_step

pytestmark = pytest.mark.integration


NONE = PolicyVersion(0, 0)


def publisher(redis_client, redis_url, run_name, module, *overrides, routes=None):
    """The publisher of rank 0; `routes`: its pusher's (all, unless given)."""
    cfg = load_config(["configs/tiny.yaml"], [f"redis.url={redis_url}", f"run.name={run_name}", *overrides])
    registry = Registry(redis_client, run_name, ttl_s=30)
    policy = SimpleNamespace(module=module)  # what the publisher reads of a ZeRO-0 engine
    pusher = WeightPusher.from_config(cfg, routes) if routes is not None else None
    return WeightPublisher(cfg, policy, 0, registry, LearnerMetrics(), pusher), registry


@pytest.fixture
def generator():
    gen = Generator(token=TOKEN)
    yield gen
    gen.stop()


def test_a_shape_mismatch_fails_the_learner_at_once(redis_client, redis_url, run_name, generator):
    other = LlamaForCausalLM(LlamaConfig(vocab_size=256, hidden_size=32, intermediate_size=64,
                                         num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=4))
    pub, registry = publisher(redis_client, redis_url, run_name, other, f"run.token={TOKEN}")
    registry.register("g0", generator.address, NONE)
    with pytest.raises(PushFailed, match=r"g0 .*rejected: INVALID_ARGUMENT shape_mismatch.*same model"):
        pub.publish(1)
    assert generator.receiver.version == NONE  # the generator kept its weights
    pub.close()


def test_a_wrong_token_fails_the_learner_at_once(redis_client, redis_url, run_name, generator):
    pub, registry = publisher(redis_client, redis_url, run_name, tiny_model(0), "run.token=wrong")
    registry.register("g0", generator.address, NONE)
    with pytest.raises(PushFailed, match="UNAUTHENTICATED.*run.token"):
        pub.publish(1)
    pub.close()


def test_the_same_weights_are_accepted(redis_client, redis_url, run_name, generator):
    pub, registry = publisher(redis_client, redis_url, run_name, tiny_model(0), f"run.token={TOKEN}")
    registry.register("g0", generator.address, NONE)
    pub.publish(1)
    assert generator.receiver.version.step == 1
    pub.close()


def test_an_unreachable_live_generator_is_retried_up_to_the_bound(redis_client, redis_url, run_name):
    pub, registry = publisher(redis_client, redis_url, run_name, tiny_model(0), "learner.push_max_failures=3",
                              "learner.push_timeout_s=5", "generator.registry_ttl_s=0.5")
    registry.register("g0", f"127.0.0.1:{free_port()}", NONE)  # registered (TTL 30 s), nothing listens
    pub.publish(1)
    pub.publish(2)  # two transient failures: warned and retried
    time.sleep(0.6)  # still registered a registry TTL after the first failure: alive, yet unreachable
    with pytest.raises(PushFailed, match=r"unreachable: UNAVAILABLE.*3 failed pushes in a row over 0.5 s"):
        pub.publish(3)
    pub.close()


def test_a_dead_generator_still_listed_is_waited_out_not_fatal(redis_client, redis_url, run_name):
    """Killed generators stay in the registry until their TTL runs out; fast steps push to them meanwhile."""
    pub, registry = publisher(redis_client, redis_url, run_name, tiny_model(0), "learner.push_max_failures=3",
                              "learner.push_timeout_s=5", "generator.registry_ttl_s=30")
    registry.register("g0", f"127.0.0.1:{free_port()}", NONE)
    for version in range(1, 6):  # five failures in a row, well within the TTL: retried, never fatal
        pub.publish(version)
    assert pub._failures["g0"] == 5
    pub.close()


def test_a_generator_listed_before_its_ttl_ran_out_is_not_fatal_when_its_push_fails_after(
        redis_client, redis_url, run_name):
    """A generator that stops answering is fatal only when a registry read made a TTL after its first failure
    still lists it; a push whose targets were read before that, and which fails after it (a slow timeout, or
    background pushes in quick succession to a dead generator), is retried like any other."""
    import socket

    silent = socket.socket()
    silent.bind(("127.0.0.1", 0))
    silent.listen(8)  # connections are queued, never answered: each push times out
    pub, registry = publisher(redis_client, redis_url, run_name, tiny_model(0), "learner.push_max_failures=2",
                              "learner.push_timeout_s=1.2", "generator.registry_ttl_s=1.0")
    registry.register("g0", f"127.0.0.1:{silent.getsockname()[1]}", NONE)
    try:
        pub.publish(1)  # first failure, 1.2 s after its targets were read
        pub.publish(2)  # read right after the first failure, failed 1.2 s later (> the TTL): not fatal
        assert pub._failures["g0"] == 2
        with pytest.raises(PushFailed, match=r"3 failed pushes in a row over 1 s"):
            pub.publish(3)  # read more than a TTL after the first failure, still listed: fatal
    finally:
        pub.close()
        silent.close()


def test_with_relays_every_live_generator_serves_each_version_and_a_dead_relay_is_pushed_around(
        redis_client, redis_url, run_name):
    """learner.relay_fanout=2 over five registered generators (as across hosts: no shared memory, each with a
    data channel): g0 is dead yet still registered; asking each how to reach it, the learner finds g0 silent
    and builds the tree over the rest: it pushes to g1 and g3, which relay to g2 and g4. (A relay that dies
    after that question: tests/integration/weights/test_relay.py.)"""
    gens = [Generator(seed=20 + i) for i in range(5)]
    learner = tiny_model(0)
    pub, registry = publisher(redis_client, redis_url, run_name, learner, f"run.token={TOKEN}",
                              "learner.relay_fanout=2", "learner.push_timeout_s=10",
                              routes=(Route.DATA, Route.STREAM))
    try:
        gens[0].stop()
        for i, g in enumerate(gens):
            registry.register(f"g{i}", g.address, NONE)
        for version in (1, 2):
            pub.publish(version)
            assert all(g.receiver.version.step == version for g in gens[1:])
            assert all(same(snapshot(g.model), snapshot(learner)) for g in gens[1:])
        sent = {f"g{i}": pub.metrics.registry.get_sample_value(LEARNER_PUSH_BYTES_TOTAL, {"target": f"g{i}"})
                for i in range(1, 5)}
        size = sum(t.numel() * t.element_size() for t in learner.state_dict().values())
        assert sent == {"g1": 2 * size, "g2": 0, "g3": 2 * size, "g4": 0}  # g2, g4: relayed by g1, g3
        routes = {r: pub.metrics.registry.get_sample_value(LEARNER_PUSHES_TOTAL, {"path": r.value})
                  for r in (Route.DATA, Route.RELAY)}
        assert routes == {Route.DATA: 4, Route.RELAY: 4}  # per version: g1 and g3 over their data channels
        assert pub._failures["g0"] == 2  # the dead one: reported, retried, not fatal within its TTL
    finally:
        pub.close()
        for g in gens:
            g.stop()


def test_delta_pushes_reach_every_generator_and_a_late_one_gets_the_version_whole(
        redis_client, redis_url, run_name):
    """learner.push_delta with bf16 pushes, two generators over the stream and the data channel, in the
    background as the learner runs by default; a third registers after version 2 and is brought up to date
    whole, then takes deltas too."""
    gens = [Generator(seed=30 + i) for i in range(3)]
    learner = tiny_model(0)
    pub, registry = publisher(redis_client, redis_url, run_name, learner, f"run.token={TOKEN}",
                              "learner.push_delta=true", "learner.push_dtype=bfloat16",
                              routes=(Route.DATA, Route.STREAM))
    try:
        for i, g in enumerate(gens[:2]):
            registry.register(f"g{i}", g.address, NONE)
        for version in (1, 2):
            train_step(learner, seed=version)
            pub.publish(version, background=True)
            pub.wait()
        registry.register("g2", gens[2].address, PolicyVersion(0, 0))
        pub._last_sync = 0.0
        pub.sync_late_generators()
        train_step(learner, seed=3)
        pub.publish(3)
        for g in gens:
            assert g.receiver.version.step == 3
            assert same(snapshot(g.model), pushed(learner, torch.bfloat16))
        get = pub.metrics.registry.get_sample_value
        versions = {e: get(LEARNER_PUSHED_VERSIONS_TOTAL, {"encoding": e}) for e in ("delta", "full")}
        assert versions == {"delta": 5, "full": 3}  # full: g0, g1 at 1, g2 late; delta: g0, g1 at 2, all at 3
        size = sum(t.numel() * 2 for t in learner.state_dict().values())
        assert get(LEARNER_PUSHED_BYTES_TOTAL, {"encoding": "full"}) == 3 * size
        assert get(LEARNER_PUSHED_BYTES_TOTAL, {"encoding": "delta"}) < 5 * 0.2 * size
    finally:
        pub.close()
        for g in gens:
            g.stop()

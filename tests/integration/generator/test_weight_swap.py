"""WeightSync into a generator in this process: a push lands between batches and replies once applied; the
generator's groups stay its own while a long push holds its backend."""

import socket
import threading

import pytest
import torch

from asyncrlhf import metrics as names
from asyncrlhf._proto.rollout_pb2 import PromptGroup
from asyncrlhf.config import load_config
from asyncrlhf.models import load_policy, load_tokenizer
from asyncrlhf.sampling.hf import HFBackend
from asyncrlhf.serving.gate import BackendGate
from asyncrlhf.streams import GENERATOR_GROUP, PROMPTS, RunStreams
from asyncrlhf.streams.holding import PendingHolder
from asyncrlhf.version import PolicyVersion
from asyncrlhf.weights.pusher import PushTarget, WeightPusher
from asyncrlhf.weights.vocabulary import Reason, Route
from services.generator.metrics import GeneratorMetrics
from services.generator.server import WeightSwap, start_weight_sync
from tests.unit.generator.peaked import perturbed_state_dict

pytestmark = pytest.mark.integration
WAIT_S = 60


def test_a_push_waits_for_the_batch_in_progress_and_replies_once_applied():
    cfg = load_config(["configs/tiny.yaml"], ["generator.device=cpu"])
    backend = HFBackend.from_config(cfg, load_tokenizer(cfg.model))
    gate, metrics = BackendGate(), GeneratorMetrics("gen-t")
    swap = WeightSwap(backend, gate, metrics)
    server = start_weight_sync(cfg, swap)
    new = perturbed_state_dict(load_policy(cfg.model), seed=9)
    target = [PushTarget("gen-t", server.address)]
    outcomes: list = []
    try:
        with WeightPusher(timeout_s=WAIT_S) as pusher:
            with gate.generating():  # a batch is running
                pusher_thread = threading.Thread(
                    target=lambda: outcomes.extend(pusher.push(new, PolicyVersion(3, 1), target)))
                pusher_thread.start()
                for _ in range(WAIT_S * 100):
                    if gate.swaps_waiting == 1:
                        break
                    threading.Event().wait(0.01)
                assert gate.swaps_waiting == 1, "the push never reached the swap"
                assert backend.version == 0 and outcomes == [] and not swap.arrived.is_set()
            pusher_thread.join(WAIT_S)
            assert [o.status for o in outcomes] == ["ok"] and outcomes[0].version == PolicyVersion(3, 1)
            assert backend.version == 1 and swap.served == PolicyVersion(3, 1) and swap.arrived.is_set()
            live = backend.named_tensors()
            assert all(torch.equal(live[name], tensor) for name, tensor in new.items())

            (stale,) = pusher.push(new, PolicyVersion(3, 1), target)
            assert (stale.status, stale.reason) == ("rejected", Reason.STALE_VERSION) and backend.version == 1
        assert metrics.registry.get_sample_value(names.GENERATOR_WEIGHT_UPDATES_TOTAL) == 1
    finally:
        server.stop()


@pytest.mark.parametrize("offered, route", [(True, Route.DATA), (False, Route.STREAM)])
def test_across_hosts_a_push_takes_the_data_channel_the_generator_offers(offered, route):
    cfg = load_config(["configs/tiny.yaml"], ["generator.device=cpu",
                                              f"generator.data_channel={str(offered).lower()}"])
    backend = HFBackend.from_config(cfg, load_tokenizer(cfg.model))
    server = start_weight_sync(cfg, WeightSwap(backend, BackendGate(), GeneratorMetrics("gen-t")))
    new = perturbed_state_dict(load_policy(cfg.model), seed=9)
    target = [PushTarget("gen-t", server.address)]
    try:
        with WeightPusher(timeout_s=WAIT_S, routes=(Route.DATA, Route.STREAM)) as pusher:  # on another host
            assert pusher.probe(target) == [route]
            assert [o.status for o in pusher.push(new, PolicyVersion(0, 1), target)] == ["ok"]
            assert backend.version == 1
        live = backend.named_tensors()
        assert all(torch.equal(live[name], tensor) for name, tensor in new.items())
    finally:
        server.stop()
    assert (server.data is not None) == offered
    if server.data is not None:  # stopping the generator closed its data port
        with pytest.raises(OSError):
            socket.create_connection(("127.0.0.1", server.data.port), timeout=2).close()


@pytest.mark.parametrize("offered, route", [(True, Route.COLLECTIVE), (False, Route.STREAM)])
def test_a_learner_with_the_collective_route_broadcasts_to_a_generator_that_offers_it(offered, route):
    cfg = load_config(["configs/tiny.yaml"], ["generator.device=cpu", "learner.device=cpu",
                                              "learner.collective=true", "generator.data_channel=false",
                                              f"generator.collective={str(offered).lower()}"])
    backend = HFBackend.from_config(cfg, load_tokenizer(cfg.model))
    server = start_weight_sync(cfg, WeightSwap(backend, BackendGate(), GeneratorMetrics("gen-t")))
    new = perturbed_state_dict(load_policy(cfg.model), seed=9)
    target = [PushTarget("gen-t", server.address)]
    try:
        with WeightPusher.from_config(cfg, routes=(Route.STREAM,)) as pusher:  # as on another host
            (outcome,) = pusher.push(new, PolicyVersion(0, 1), target)
            assert (outcome.status, outcome.route) == ("ok", route) and backend.version == 1
        live = backend.named_tensors()  # the served weights are the pushed ones
        assert all(torch.equal(live[name], tensor) for name, tensor in new.items())
    finally:
        server.stop()


class SlowLoad(HFBackend):
    """The tiny HF backend whose load waits until `loaded` is set: a push that holds the gate as long as a
    long broadcast or a large model's reload does."""

    loaded = threading.Event()

    def apply_weights(self, tensors, version, *, adopt=False):
        assert self.loaded.wait(WAIT_S), "the test never let the load end"
        return super().apply_weights(tensors, version, adopt=adopt)


def test_a_push_longer_than_claim_idle_ms_keeps_the_generators_groups_from_being_reclaimed(redis_client,
                                                                                             run_name):
    """The loop waits while a push holds its backend and cannot hold its groups itself: the swap holds every
    entry pending to it meanwhile, so another generator's XAUTOCLAIM, past `claim_idle_ms` on the clock,
    takes none (without the swap's holds the entries' idle time passes it: they would be taken)."""
    idle_ms = 1000
    cfg = load_config(["configs/tiny.yaml"], ["generator.device=cpu", f"redis.claim_idle_ms={idle_ms}",
                                              f"run.name={run_name}"])
    streams = RunStreams(redis_client, run_name, cfg.redis)
    streams.producer(PROMPTS).add_many(
        [PromptGroup(group_id=f"g{i}", prompt_token_ids=[1, 2, i], k=2) for i in range(3)])
    ours = streams.consumer(PROMPTS, GENERATOR_GROUP, "gen-a")
    assert len(ours.read(3, block_ms=0)) == 3  # in flight in gen-a's engine
    backend = SlowLoad.from_config(cfg, load_tokenizer(cfg.model))
    swap = WeightSwap(backend, BackendGate(), GeneratorMetrics("gen-a"), pending=PendingHolder(ours, idle_ms))
    new = perturbed_state_dict(load_policy(cfg.model), seed=9)
    push = threading.Thread(target=swap.apply_weights, args=(new, PolicyVersion(1, 1)))
    push.start()
    try:
        threading.Event().wait(3 * idle_ms / 1000)  # the push holds the gate three claim_idle_ms long
        taken = redis_client.xautoclaim(ours.key, GENERATOR_GROUP, "gen-b", idle_ms, justid=True)
        assert taken == []
    finally:
        SlowLoad.loaded.set()
        push.join(WAIT_S)
    assert backend.version == 1
    pending = redis_client.xpending_range(ours.key, GENERATOR_GROUP, "-", "+", 10)
    assert {p["consumer"] for p in pending} == {b"gen-a"} and len(pending) == 3

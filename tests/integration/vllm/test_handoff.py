"""Pushes into a vLLM engine that runs in a process of its own (`generator.vllm.engine_in_process=false`, the
GPU default), its worker taking the collective route's rounds and every other route's versions handed over
by shared memory: over every route, the engine serves the pushed model's log-probs, and no file is created
or written per version (a watchdog observer on the cache directory, the engine's work directory within it,
and on /dev/shm). The generator service offers the engine's worker to the learner's weight groups. (What
every hop guarantees, refusals included: `test_hop_contract.py`.) Stepped
continuously, the engine process's own account labels every token with the weights that sampled it, though
it samples ahead of the loop that reads the tokens; a prompt seen before a push is prefilled again by the new
weights, though sequences in flight keep the prefix cache from being reset; and a generator's loop is the only
thread that talks to the engine while pushes arrive over gRPC as groups are added."""

from __future__ import annotations

import threading
import time

import pytest
import torch
from watchdog.observers import Observer

from asyncrlhf._proto.rollout_pb2 import PromptGroup, RolloutGroup
from asyncrlhf.bench.enginepush import compare, report
from asyncrlhf.config import SamplingConfig
from asyncrlhf.models import encode_prompts, load_policy, load_tokenizer
from asyncrlhf.sampling.continuous import ContinuousSampler, GroupPrompt
from asyncrlhf.sampling.hops.hop import HopKind
from asyncrlhf.sampling.hops.shared_memory import SharedMemory
from asyncrlhf.sampling.single_turn import Completions, Progress
from asyncrlhf.sampling.vllm_stepping import VLLMStepEngine
from asyncrlhf.serving.gate import BackendGate
from asyncrlhf.streams import PAYLOAD_FIELD, PROMPTS, ROLLOUTS, RunStreams, run_key
from asyncrlhf.version import PolicyVersion
from asyncrlhf.weights.channel_read import DataListener
from asyncrlhf.weights.pusher import PushTarget, WeightPusher
from asyncrlhf.weights.receiver import WeightReceiver
from asyncrlhf.weights.server import serve
from asyncrlhf.weights.shm import SHM_DIR
from asyncrlhf.weights.vocabulary import Route
from services.generator.metrics import GeneratorMetrics
from services.generator.run import GeneratorService
from services.generator.server import WeightSwap, start_weight_sync
from tests.integration.vllm.helpers import PARITY_ATOL, Writes, max_gap, reference_logprobs, vllm_config
from tests.unit.generator.peaked import perturbed_state_dict

pytestmark = [pytest.mark.integration, pytest.mark.vllm]
SAMPLING = SamplingConfig(temperature=0.8, max_new_tokens=6)


@pytest.fixture(scope="module")
def engine(tmp_path_factory):
    from asyncrlhf.sampling.vllm import VLLMBackend

    cache = tmp_path_factory.mktemp("vllm-cache")
    cfg = vllm_config(cache, "generator.vllm.engine_in_process=false")
    tokenizer = load_tokenizer(cfg.model)
    backend = VLLMBackend.from_config(cfg, tokenizer)
    prompts = encode_prompts(tokenizer, ["hello", "a longer prompt than that"], cfg.model)
    yield cfg, cache, backend, prompts
    segment = backend.hop.handed.handoff.segment
    backend.close()
    assert segment is None or not segment.path.exists()


@pytest.fixture(scope="module")
def weightsync(engine):
    _, _, backend, _ = engine
    data = DataListener()
    server, port = serve(WeightReceiver(backend, data=data))
    yield PushTarget("vllm-0", f"127.0.0.1:{port}")
    server.stop(0)
    data.close()


@pytest.mark.parametrize("route", [Route.SHM, Route.DATA, Route.STREAM])
def test_every_route_reaches_an_engine_process_with_no_file_per_version(engine, weightsync, route):
    cfg, cache, backend, prompts = engine
    assert backend.hop.kind is HopKind.WORKER_ROUND and isinstance(backend.hop.handed, SharedMemory)
    handoff = backend.hop.handed.handoff  # the worker round hands over by shared memory what reaches us
    learner = load_policy(cfg.model).eval()
    writes = Writes()
    observer = Observer()
    observer.schedule(writes, str(cache), recursive=True)
    observer.schedule(writes, str(SHM_DIR), recursive=False)
    start = backend.version
    with WeightPusher(routes=(route, Route.STREAM), chunk_bytes=64 << 10) as pusher:
        assert pusher.probe([weightsync]) == [route]
        # the first version of a route may make its segments (the learner's, the handoff's): not watched
        warm = perturbed_state_dict(learner, seed=start + 1, scale=0.2)
        (outcome,) = pusher.push(warm, PolicyVersion(0, start + 1), [weightsync])
        assert outcome.status == "ok", outcome.detail
        segment = handoff.segment.name
        observer.start()
        try:
            for step in (start + 2, start + 3, start + 4):
                weights = perturbed_state_dict(learner, seed=step, scale=0.2)
                (outcome,) = pusher.push(weights, PolicyVersion(0, step), [weightsync])
                assert outcome.status == "ok", outcome.detail
                assert backend.version == step
                learner.load_state_dict(weights)
                groups = backend.generate(prompts, 2, SAMPLING)
                assert max_gap(learner, prompts, groups, SAMPLING) <= PARITY_ATOL
            writes.settle(cache)
        finally:
            observer.stop()
            observer.join()
    assert writes.take() == []
    assert handoff.segment.name == segment  # rewritten in place, version after version
    assert not list(backend.work_dir.iterdir())


def test_a_continuous_engine_process_labels_each_token_with_the_weights_that_sampled_it(engine):
    # The loop reads a step's tokens after the engine process sampled them, and may have applied a push in
    # between: the labels come from the engine (paused for the swap), so each token's behaviour log-prob is
    # that of the weights its label names. KV recomputed after the push: the new weights' exact log-probs.
    cfg, _, backend, prompts = engine
    policy = load_policy(cfg.model).eval()
    first = backend.version + 1
    weights = {first: perturbed_state_dict(policy, seed=31, scale=0.2),
               first + 1: perturbed_state_dict(policy, seed=32, scale=0.2)}
    long = SamplingConfig(temperature=1.0, max_new_tokens=48)
    backend.apply_weights(weights[first], PolicyVersion(0, first))
    backend.driver, backend.recompute_inflight = VLLMStepEngine(backend), True
    try:
        sampler: ContinuousSampler[str, Progress] = ContinuousSampler(backend.driver, Completions(), long)
        runs = [sampler.start(f"t{i}", f"g{i}", GroupPrompt(p), 2, lineage=0) for i, p in enumerate(prompts)]
        for _ in range(6):
            sampler.step(first)
        backend.apply_weights(weights[first + 1], PolicyVersion(0, first + 1))
        while sampler.running_samples:
            sampler.step(first + 1)
    finally:
        backend.driver, backend.recompute_inflight = None, False
    straddled = 0
    for run in runs:
        for sample in run.samples:
            ids, n = sample.token_ids, len(sample.token_ids)
            m = sample.versions.index(first + 1) if first + 1 in sample.versions else n
            assert sample.versions == [first] * m + [first + 1] * (n - m)
            straddled += 0 < m < n
            for version, (lo, hi) in ((first, (0, m)), (first + 1, (m, n))):
                if lo == hi:
                    continue
                policy.load_state_dict(weights[version])
                expected = reference_logprobs(policy, run.prompt.ids + ids[:lo], ids[lo:hi], long)
                gap = (torch.tensor(sample.logprobs[lo:hi]) - expected).abs().max().item()
                assert gap <= PARITY_ATOL, (version, lo, hi, gap)
    assert straddled, "no sample was sampled by both versions: lengthen the sampling"


def test_the_generator_service_offers_its_engine_workers_weight_group(engine):
    # `start_weight_sync` (the generator service) joins weight groups through the engine's worker, and a
    # learner configured with the collective route broadcasts to it
    cfg, _, backend, _ = engine
    cfg = cfg.model_copy(update={"learner": cfg.learner.model_copy(update={"collective": True})})
    server = start_weight_sync(cfg, WeightSwap(backend, BackendGate(), GeneratorMetrics("gen-vllm")))
    target = PushTarget("gen-vllm", server.address)
    try:
        assert server.collective is backend.hop.rounds is not None
        weights = perturbed_state_dict(load_policy(cfg.model).eval(), seed=55, scale=0.2)
        with WeightPusher.from_config(cfg, routes=(Route.STREAM,)) as pusher:
            (outcome,) = pusher.push(weights, PolicyVersion(0, backend.version + 1), [target])
        assert (outcome.status, outcome.route) == ("ok", Route.COLLECTIVE), outcome.detail
    finally:
        server.stop()


def test_the_push_bench_times_every_path_into_the_engine_process(engine):
    # `asyncrlhf bench generator --push` on this engine: the handoff, a file and the collective route
    # received by the worker, each push committed (the bench raises otherwise), each figure reported
    cfg, _, backend, _ = engine
    result = compare(cfg, repeats=1, engine=backend)
    assert {mode: len(t) for mode, t in result["times"].items()} == {"shm": 2, "file": 2, "collective": 2}
    assert all(s > 0 for t in result["times"].values() for s in t)
    assert result["collective_ratio"] == result["collective_step_to_serve_s"] / result["file_step_to_serve_s"]
    assert any("collective, received by the engine's worker" in line for line in report(result))
    assert backend.hop.kind is HopKind.WORKER_ROUND  # restored
    assert not list(backend.work_dir.iterdir())  # no file left


def test_after_a_push_a_prompt_seen_before_is_prefilled_by_the_new_weights_while_sequences_run(engine):
    # A sequence in flight across the push holds KV blocks, so vLLM would refuse to reset the prefix cache
    # ("some blocks are not freed yet"). The prompt seen before the push (longer than a KV block: 128 tokens
    # on CPU, so its first block is cached) must not reuse the old weights' blocks: the token sampled after
    # it has exactly the new weights' log-prob (temperature 1: the model's own distribution).
    cfg, _, backend, prompts = engine
    policy = load_policy(cfg.model).eval()
    first = backend.version + 1
    weights = {first: perturbed_state_dict(policy, seed=41, scale=0.2),
               first + 1: perturbed_state_dict(policy, seed=42, scale=0.2)}
    seen, sampling = (prompts[1] * 20)[:140], SamplingConfig(temperature=1.0)
    backend.apply_weights(weights[first], PolicyVersion(0, first))
    driver = backend.driver = VLLMStepEngine(backend)
    try:
        driver.add("in-flight", prompts[0], 200, sampling)
        driver.add("seen", seen, 1, sampling)
        ended = ended_by(driver, "seen")
        backend.apply_weights(weights[first + 1], PolicyVersion(0, first + 1))
        driver.add("seen-again", seen, 1, sampling)
        ended |= ended_by(driver, "seen-again")
        assert "in-flight" not in ended  # it held its blocks across the push
        driver.abort(["in-flight"])
    finally:
        backend.driver = None
    policy.load_state_dict(weights[first + 1])
    token, logprob = ended["seen-again"]
    assert abs(logprob - reference_logprobs(policy, seen, [token], sampling).item()) <= PARITY_ATOL


def ended_by(driver: VLLMStepEngine, key: str) -> dict[str, tuple[int, float]]:
    """Step until sequence `key` ends: the first token and its log-prob of each sequence that ended."""
    ended: dict[str, tuple[int, float]] = {}
    while key not in ended:
        for delta in driver.step():
            if delta.finish is not None:
                ended[delta.key] = (delta.token_ids[0], delta.logprobs[0])
    return ended


class SocketEntries:
    """Watches the real client of an engine in a process of its own (vLLM's `SyncMPClient`): the threads
    that send on its socket (every add, abort and utility call goes through `_send_input`), and whether two
    ever sent at once."""

    def __init__(self, client) -> None:
        self.client, self.threads, self.overlaps = client, set(), 0
        self._inside, self._lock = 0, threading.Lock()
        send = client._send_input

        def watched(*args, **kwargs):
            with self._lock:
                self._inside += 1
                self.overlaps += self._inside > 1
                self.threads.add(threading.current_thread().name)
            try:
                return send(*args, **kwargs)
            finally:
                with self._lock:
                    self._inside -= 1

        client._send_input = watched

    def close(self) -> None:
        del self.client._send_input


def test_only_the_loops_thread_talks_to_the_engine_while_pushes_arrive_and_groups_are_added(
        engine, redis_client, redis_url, run_name):
    # The generator service, continuous, on the engine process: groups are read and added while the learner
    # pushes versions over gRPC. The push's pause, load, label and resume go to the loop's thread, which runs
    # them between two steps: one thread ever sends on the client's socket (on a ZMQ socket, two at once
    # garble a message and kill the engine). Another thread that tries to step is refused; once the loop has
    # stopped, a push is refused (the generator is stopping) and the version served stays.
    base, _, backend, prompts = engine
    cfg = base.model_copy(update={
        "run": base.run.model_copy(update={"name": run_name}),
        "redis": base.redis.model_copy(update={"url": redis_url, "block_ms": 50}),
        "generator": base.generator.model_copy(update={
            "mode": "continuous", "samples_per_prompt": 2, "batch_prompts": 2,
            "sampling": SamplingConfig(temperature=1.0, max_new_tokens=12)})})
    producer = RunStreams(redis_client, run_name, cfg.redis).producer(PROMPTS)
    for i in range(8):
        producer.add(PromptGroup(group_id=f"g{i:08d}", prompt_token_ids=prompts[i % 2], k=2,
                                 enqueued_at=time.time()))
    learner = load_policy(cfg.model).eval()
    service = GeneratorService(cfg, backend=backend, tokenizer=load_tokenizer(cfg.model), client=redis_client)
    entries = SocketEntries(backend.llm.llm_engine.engine_core)
    outcomes: list = []
    try:
        service.start()
        target = PushTarget(service.id, service.weight_sync.address)

        def pushes() -> None:
            with WeightPusher.from_config(cfg, routes=(Route.SHM,)) as pusher:
                for step in range(backend.version + 1, backend.version + 5):
                    weights = perturbed_state_dict(learner, seed=60 + step, scale=0.2)
                    outcomes.extend(pusher.push(weights, PolicyVersion(1, step), [target]))
                    time.sleep(0.2)  # pushes land among the loop's adds and steps

        pusher = threading.Thread(target=pushes, name="learner")
        pusher.start()
        deadline, added = time.monotonic() + 180, 8
        while pusher.is_alive() or service.loop.sampler.groups:
            assert time.monotonic() < deadline, "the loop did not write the groups"
            if pusher.is_alive() and len(service.loop.sampler.groups) < 2 and added < 32:
                # groups keep arriving while pushes do, however slow the host, so tokens span versions
                producer.add(PromptGroup(group_id=f"g{added:08d}", prompt_token_ids=prompts[added % 2], k=2,
                                         enqueued_at=time.time()))
                added += 1
            service.loop.step()
        pusher.join()
        refused: list[str] = []

        def intrude() -> None:
            try:
                service.loop.engine.step()
            except RuntimeError as err:
                refused.append(str(err))

        intruder = threading.Thread(target=intrude)
        intruder.start()
        intruder.join()
        service.loop.hand_on()  # the end of the loop's `run`
        service.loop.engine.fail_waiting("the generator is stopping")
        served = backend.version
        with WeightPusher.from_config(cfg, routes=(Route.SHM,)) as late:
            (after_stop,) = late.push(perturbed_state_dict(learner, seed=70, scale=0.2),
                                      PolicyVersion(1, served + 1), [target])
    finally:
        entries.close()
        service.close()
        backend.driver, backend.recompute_inflight = None, False
    assert [o.status for o in outcomes] == ["ok"] * 4, [o.detail for o in outcomes]
    assert entries.threads == {threading.current_thread().name} and entries.overlaps == 0, entries.threads
    assert refused and "only the thread that built it talks to the engine" in refused[0]
    assert after_stop.status != "ok" and "the generator is stopping" in after_stop.detail, after_stop.detail
    assert backend.version == served
    written = [RolloutGroup.FromString(f[PAYLOAD_FIELD])
               for _, f in redis_client.xrange(run_key(run_name, ROLLOUTS.name))]
    assert len({v for g in written for s in g.samples for v in s.token_versions}) > 1  # across pushes

"""Pushes into a vLLM engine that runs in a process of its own (`generator.vllm.engine_in_process=false`, the
GPU default), through its shared-memory handoff: over every route, the engine serves the pushed model's
log-probs, and no file is created or written per version (a watchdog observer on the cache directory, the
engine's work directory within it, and on /dev/shm); bytes that change between the generator's check and
the worker's load are refused by the worker, and the engine keeps serving the old version. Over the
collective route the engine's worker joins the weight group itself and checks each bucket. Stepped
continuously, the engine process's own account labels every token with the weights that sampled it, though
it samples ahead of the loop that reads the tokens."""

from __future__ import annotations

import os
import threading

import pytest
import torch
from watchdog.events import FileSystemEvent, FileSystemEventHandler
from watchdog.observers import Observer

from asyncrlhf.bench.enginepush import compare, report
from asyncrlhf.config import SamplingConfig
from asyncrlhf.models import encode_prompts, load_policy, load_tokenizer
from asyncrlhf.sampling.continuous import ContinuousSampler
from asyncrlhf.sampling.vllm_stepping import VLLMStepEngine
from asyncrlhf.serving.gate import BackendGate
from asyncrlhf.version import PolicyVersion
from asyncrlhf.weights.channel import DataListener
from asyncrlhf.weights.collective_sender import CollectiveSender
from asyncrlhf.weights.handoff import Handoff, HandoffMismatch
from asyncrlhf.weights.pusher import PushTarget, WeightPusher
from asyncrlhf.weights.receiver import WeightReceiver
from asyncrlhf.weights.server import serve
from asyncrlhf.weights.shm import SHM_DIR
from asyncrlhf.weights.stream import StreamSender
from asyncrlhf.weights.vocabulary import Reason, Route
from services.generator.metrics import GeneratorMetrics
from services.generator.server import WeightSwap, start_weight_sync
from tests.integration.vllm.helpers import PARITY_ATOL, max_gap, reference_logprobs, vllm_config
from tests.integration.weights.routes import FlippingSender
from tests.unit.generator.peaked import perturbed_state_dict

pytestmark = [pytest.mark.integration, pytest.mark.vllm]
SAMPLING = SamplingConfig(temperature=0.8, max_new_tokens=6)


class Writes(FileSystemEventHandler):
    """Every file created, written, moved or deleted under the watched directories."""

    def __init__(self) -> None:
        self.events: list[str] = []
        self._lock = threading.Lock()

    def on_any_event(self, event: FileSystemEvent) -> None:
        # /dev/shm/sem.*: POSIX semaphores (multiprocessing's locks, any process on the host), not weights
        if event.event_type in ("created", "modified", "moved", "deleted", "closed") and \
                not event.is_directory and not os.path.basename(event.src_path).startswith("sem."):
            with self._lock:
                self.events.append(f"{event.event_type} {event.src_path}")

    def take(self) -> list[str]:
        with self._lock:
            events, self.events = self.events, []
        return events


@pytest.fixture(scope="module")
def engine(tmp_path_factory):
    from asyncrlhf.sampling.vllm import VLLMBackend

    cache = tmp_path_factory.mktemp("vllm-cache")
    cfg = vllm_config(cache, "generator.vllm.engine_in_process=false")
    tokenizer = load_tokenizer(cfg.model)
    backend = VLLMBackend.from_config(cfg, tokenizer)
    prompts = encode_prompts(tokenizer, ["hello", "a longer prompt than that"], cfg.model)
    yield cfg, cache, backend, prompts
    segment = backend.handoff.segment
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
    assert not backend.in_process and backend.handoff is not None
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
        segment = backend.handoff.segment.name
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
        finally:
            observer.stop()
            observer.join()
    assert writes.take() == []
    assert backend.handoff.segment.name == segment  # rewritten in place, version after version
    assert not list(backend.work_dir.iterdir())


class Corrupting(Handoff):
    """A handoff whose segment changes after it was written and hashed (what a stray writer would do)."""

    def write(self, tensors):
        manifest = super().write(tensors)
        _, _, _, offset, _, _ = manifest["tensors"][0]
        self.segment.map[offset] ^= 0xFF
        return manifest


def test_bytes_that_change_after_the_check_are_refused_by_the_worker_and_the_old_version_serves(
        engine, weightsync):
    cfg, _, backend, prompts = engine
    learner = load_policy(cfg.model).eval()
    good = perturbed_state_dict(learner, seed=40, scale=0.2)
    served = backend.version + 1
    with WeightPusher(routes=(Route.STREAM,)) as pusher:
        (outcome,) = pusher.push(good, PolicyVersion(0, served), [weightsync])
        assert outcome.status == "ok", outcome.detail
        learner.load_state_dict(good)
        honest, backend.handoff = backend.handoff, Corrupting()
        try:
            bad = perturbed_state_dict(learner, seed=41, scale=0.2)
            with pytest.raises(Exception, match=HandoffMismatch.__name__ + "|not those the generator"):
                backend.apply_weights(bad, PolicyVersion(0, served + 1))
            (outcome,) = pusher.push(bad, PolicyVersion(0, served + 1), [weightsync])
            assert outcome.status != "ok"
        finally:
            backend.handoff.close()
            backend.handoff = honest
    assert backend.version == served
    groups = backend.generate(prompts, 2, SAMPLING)
    assert max_gap(learner, prompts, groups, SAMPLING) <= PARITY_ATOL
    assert torch.isfinite(torch.tensor([lp for g in groups for c in g for lp in c.logprobs])).all()


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
        sampler: ContinuousSampler[str] = ContinuousSampler(backend.driver, long)
        runs = [sampler.start(f"t{i}", f"g{i}", p, 2, lineage=0) for i, p in enumerate(prompts)]
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
                expected = reference_logprobs(policy, run.prompt_ids + ids[:lo], ids[lo:hi], long)
                gap = (torch.tensor(sample.logprobs[lo:hi]) - expected).abs().max().item()
                assert gap <= PARITY_ATOL, (version, lo, hi, gap)
    assert straddled, "no sample was sampled by both versions: lengthen the sampling"


def test_the_engine_worker_joins_the_weight_group_and_serves_each_broadcast_version(engine):
    # The collective route received by the engine process's worker itself: the buckets never pass through the
    # generator's process, no file is made, the served log-probs move to the pushed model's, and a bucket
    # changed after the learner hashed it is refused by the worker with the old version serving.
    cfg, cache, backend, prompts = engine
    member = backend.engine_member
    assert member is not None and member.backends == ("gloo",)
    server, port = serve(WeightReceiver(backend, collective=member))
    target = PushTarget("vllm-engine-member", f"127.0.0.1:{port}")
    learner = load_policy(cfg.model).eval()
    writes = Writes()
    observer = Observer()
    observer.schedule(writes, str(cache), recursive=True)
    observer.schedule(writes, str(SHM_DIR), recursive=False)
    bucket = 64 << 10  # the tiny model (451 KiB) in several buckets
    try:
        with WeightPusher(route_senders=[CollectiveSender(bucket_bytes=bucket, timeout_s=60.0),
                                         StreamSender(64 << 10)], timeout_s=120) as pusher:
            observer.start()
            for step in range(backend.version + 1, backend.version + 4):
                weights = perturbed_state_dict(learner, seed=100 + step, scale=0.2)
                before = backend.generate(prompts, 2, SAMPLING)
                (outcome,) = pusher.push(weights, PolicyVersion(0, step), [target])
                assert (outcome.status, outcome.route) == ("ok", Route.COLLECTIVE), outcome.detail
                assert backend.version == step
                learner.load_state_dict(weights)
                assert max_gap(learner, prompts, before, SAMPLING) > 10 * PARITY_ATOL  # not yet served...
                groups = backend.generate(prompts, 2, SAMPLING)
                assert max_gap(learner, prompts, groups, SAMPLING) <= PARITY_ATOL  # ...and now served
            served = backend.version
            with WeightPusher(route_senders=[FlippingSender(bucket_bytes=bucket, timeout_s=60.0)],
                              timeout_s=120) as flipping:
                bad = perturbed_state_dict(learner, seed=7, scale=0.2)
                (outcome,) = flipping.push(bad, PolicyVersion(0, served + 1), [target])
            assert (outcome.status, outcome.reason) == ("rejected", Reason.BAD_CHECKSUM), outcome.detail
            assert "bucket 1 as the worker received it" in outcome.detail
    finally:
        observer.stop()
        observer.join()
        server.stop(0)
    assert writes.take() == []
    assert backend.version == served
    groups = backend.generate(prompts, 2, SAMPLING)
    assert max_gap(learner, prompts, groups, SAMPLING) <= PARITY_ATOL


def test_the_generator_service_offers_its_engine_workers_weight_group(engine):
    # `start_weight_sync` (the generator service) joins weight groups through the engine's worker, and a
    # learner configured with the collective route broadcasts to it
    cfg, _, backend, _ = engine
    cfg = cfg.model_copy(update={"learner": cfg.learner.model_copy(update={"collective": True})})
    server = start_weight_sync(cfg, WeightSwap(backend, BackendGate(), GeneratorMetrics("gen-vllm")))
    target = PushTarget("gen-vllm", server.address)
    try:
        assert server.collective is backend.engine_member
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
    assert backend.handoff is not None and not list(backend.work_dir.iterdir())  # restored, no file left

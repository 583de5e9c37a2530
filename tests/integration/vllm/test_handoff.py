"""Pushes into a vLLM engine that runs in a process of its own (`generator.vllm.engine_in_process=false`, the
GPU default), through its shared-memory handoff: over every route, the engine serves the pushed model's
log-probs, and no file is created or written per version (a watchdog observer on the cache directory, the
engine's work directory within it, and on /dev/shm); bytes that change between the generator's check and
the worker's load are refused by the worker, and the engine keeps serving the old version."""

from __future__ import annotations

import os
import threading

import pytest
import torch
from watchdog.events import FileSystemEvent, FileSystemEventHandler
from watchdog.observers import Observer

from asyncrlhf.config import SamplingConfig
from asyncrlhf.models import encode_prompts, load_policy, load_tokenizer
from asyncrlhf.version import PolicyVersion
from asyncrlhf.weights.channel import DataListener
from asyncrlhf.weights.handoff import Handoff, HandoffMismatch
from asyncrlhf.weights.pusher import PushTarget, WeightPusher
from asyncrlhf.weights.receiver import WeightReceiver
from asyncrlhf.weights.server import serve
from asyncrlhf.weights.shm import SHM_DIR
from asyncrlhf.weights.vocabulary import Route
from tests.integration.vllm.helpers import PARITY_ATOL, max_gap, vllm_config
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

"""Pushes over real gRPC: bit-exact round trips, partial pushes, between batches; fan-out to many targets."""

from __future__ import annotations

import socket
import threading
import time

import grpc
import pytest
import torch

from asyncrlhf.weights.pusher import PushTarget
from tests.integration.weights.helpers import ONLY, Generator, push, pusher, same, snapshot, version

pytestmark = pytest.mark.integration


def test_fp32_push_is_bit_exact(generator, learner, direct_route):
    with pusher(routes=ONLY[direct_route]) as by:
        outcome = push(by, learner.state_dict(), 1, generator)
        assert (outcome.status, outcome.version, outcome.route) == ("ok", version(1), direct_route)
        assert same(snapshot(generator.model), snapshot(learner))
        assert by.get_status(generator.address).version == 1
        assert outcome.bytes == sum(t.numel() * 4 for t in learner.state_dict().values())


@pytest.mark.parametrize("dtype, torch_dtype", [("bfloat16", torch.bfloat16), ("float16", torch.float16)])
def test_half_precision_push_is_within_rounding(generator, learner, dtype, torch_dtype, direct_route):
    with pusher(routes=ONLY[direct_route], dtype=dtype) as by:
        assert push(by, learner.state_dict(), 1, generator).status == "ok"
    got, want = snapshot(generator.model), snapshot(learner)
    for name in want:
        assert got[name].dtype == torch.float32  # the live dtype is kept
        # exactly the fp32 value rounded to the push dtype, so within half an ulp of it
        assert torch.equal(got[name], want[name].to(torch_dtype).to(torch.float32)), name
    tol = torch.finfo(torch_dtype).eps
    assert all(torch.allclose(got[n], want[n], rtol=tol, atol=1e-6) for n in want)


def test_partial_push_updates_only_the_named_tensors(learner, direct_route):
    names = [n for n in learner.state_dict() if n.endswith("q_proj.weight")]
    gen = Generator(names=names)
    try:
        before = snapshot(gen.model)
        subset = {n: learner.state_dict()[n] for n in names}
        with pusher(routes=ONLY[direct_route]) as by:
            assert push(by, subset, 1, gen, partial=True).status == "ok"
        after = snapshot(gen.model)
        assert all(torch.equal(after[n], subset[n]) for n in names)
        assert all(torch.equal(after[n], before[n]) for n in after if n not in names)
    finally:
        gen.stop()


def test_push_waits_for_the_generation_batch(generator, learner, direct_route):
    """The generator holds the target's lock while it generates: the swap lands after, never during."""
    generator.target.lock.acquire()
    results = []
    with pusher(routes=ONLY[direct_route]) as by:
        def push_v1():
            results.append(push(by, learner.state_dict(), 1, generator))

        thread = threading.Thread(target=push_v1)
        thread.start()
        time.sleep(0.5)
        assert not results and not same(snapshot(generator.model), snapshot(learner))
        generator.target.lock.release()
        thread.join(30)
    assert results[0].status == "ok" and same(snapshot(generator.model), snapshot(learner))


def test_fan_out_updates_live_targets_and_reports_dead_ones_within_the_deadline(learner):
    live = [Generator(seed=1), Generator(seed=2)]
    closed = Generator(seed=3)
    closed.stop()  # nothing listens on its port any more
    hung = socket.socket()  # accepts TCP connections, never speaks HTTP/2: a hung generator
    hung.bind(("127.0.0.1", 0))
    hung.listen(8)
    targets = [PushTarget("g0", live[0].address), PushTarget("g1", closed.address),
               PushTarget("g2", live[1].address), PushTarget("g3", f"127.0.0.1:{hung.getsockname()[1]}")]
    deadline_s = 3.0
    try:
        with pusher(timeout_s=deadline_s) as by:
            start = time.perf_counter()
            outcomes = by.push(learner.state_dict(), version(5), targets)
            elapsed = time.perf_counter() - start
        assert [o.target.id for o in outcomes] == ["g0", "g1", "g2", "g3"]
        assert [o.status for o in outcomes] == ["ok", "unreachable", "ok", "unreachable"]
        assert outcomes[1].code == grpc.StatusCode.UNAVAILABLE
        assert outcomes[3].code == grpc.StatusCode.DEADLINE_EXCEEDED
        assert elapsed < deadline_s + 2.0  # the dead ones did not hold up the push past the deadline
        for gen in live:
            assert gen.receiver.version == version(5) and same(snapshot(gen.model), snapshot(learner))
    finally:
        hung.close()
        for gen in live:
            gen.stop()

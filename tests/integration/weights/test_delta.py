"""Delta pushes over real gRPC on every route: bit-exact round trips onto the version served, a generator on
another base gets the version whole, a delta larger than its tensor is sent whole, a corrupted delta is
refused by the resulting tensor's checksum, a relay forwards the version whole, and collective members get
it whole."""

from __future__ import annotations

import dataclasses
import time

import pytest
import torch

from asyncrlhf.weights.access import ClientAccess
from asyncrlhf.weights.codec import Snapshot
from asyncrlhf.weights.collective_sender import CollectiveSender
from asyncrlhf.weights.pusher import RelayPlan, WeightPusher
from asyncrlhf.weights.relay import Relay, relay_pusher
from asyncrlhf.weights.stream import StreamSender
from asyncrlhf.weights.vocabulary import Reason, Route
from tests.integration.weights.helpers import CHUNK, ONLY, TOKEN, Generator, push, pusher, snapshot, version
from tests.integration.weights.routes import BUCKET, Fault, Faulty, sender

pytestmark = pytest.mark.integration


def train_step(model: torch.nn.Module, share: float = 0.01, seed: int = 0) -> None:
    """Move about `share` of every tensor's elements (as a step of full fine-tuning moves a few percent of
    the bf16 weights)."""
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in model.parameters():
            p[torch.rand(p.shape, generator=gen) < share] += 0.5


def pushed(model: torch.nn.Module, dtype: torch.dtype) -> dict[str, torch.Tensor]:
    """The model as a generator serving its `dtype` push holds it (fp32 live)."""
    return {k: v.detach().to(dtype).to(torch.float32) for k, v in model.state_dict().items()}


def same(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> bool:
    return a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


def full_bytes(model: torch.nn.Module, itemsize: int) -> int:
    return sum(t.numel() * itemsize for t in model.state_dict().values())


@pytest.mark.parametrize("dtype", ["bfloat16", "float32"])
def test_delta_pushes_land_bit_exact_on_the_version_served(generator, learner, direct_route, dtype):
    """bf16: the generator copies each version into its fp32 weights (the base is its staging buffer); fp32:
    it adopts the staged tensors (the base is its live storage, or the learner's segment)."""
    torch_dtype = getattr(torch, dtype)
    with pusher(routes=ONLY[direct_route], dtype=dtype, delta=True) as by:
        first = push(by, learner.state_dict(), 1, generator)
        assert (first.status, first.encoding) == ("ok", "full")
        for step in (2, 3, 4):
            train_step(learner, seed=step)
            outcome = push(by, learner.state_dict(), step, generator)
            assert (outcome.status, outcome.encoding, outcome.route) == ("ok", "delta", direct_route), \
                outcome.detail
            assert outcome.version == version(step)
            assert outcome.bytes < 0.2 * full_bytes(learner, torch_dtype.itemsize)
            assert same(snapshot(generator.model), pushed(learner, torch_dtype)), step


def test_a_generator_on_another_base_gets_the_version_whole(learner, direct_route):
    """On shared memory both generators are local: a round writes one segment, so both get version 3 whole
    there, and the refused delta goes whole over the stream."""
    a, b = Generator(), Generator(seed=2)
    local = direct_route == Route.SHM
    try:
        with pusher(routes=ONLY[direct_route], dtype="bfloat16", delta=True) as by:
            both = [a.target_id, b.target_id]
            assert [o.encoding for o in by.push(learner.state_dict(), version(1), both)] == ["full", "full"]
            train_step(learner, seed=2)
            assert by.push(learner.state_dict(), version(2), [a.target_id])[0].encoding == "delta"
            train_step(learner, seed=3)
            outcomes = by.push(learner.state_dict(), version(3), both)
            # b kept version 1, the delta is onto version 2: b gets version 3 whole
            assert [(o.status, o.encoding) for o in outcomes] == [("ok", "full" if local else "delta"),
                                                                  ("ok", "full")]
            assert outcomes[1].bytes == full_bytes(learner, 2)
            for gen in (a, b):
                assert same(snapshot(gen.model), pushed(learner, torch.bfloat16))

            # another pusher (no deltas) moves a on: its base is gone, which the learner cannot know. The
            # delta it sends is refused (`delta_base`), and a gets the version whole in the same push.
            train_step(learner, seed=4)
            with pusher(routes=ONLY[direct_route], dtype="bfloat16") as other:
                assert push(other, learner.state_dict(), 4, a).status == "ok"
            train_step(learner, seed=5)
            outcome = push(by, learner.state_dict(), 5, a)
            assert (outcome.status, outcome.encoding) == ("ok", "full"), outcome.detail
            assert outcome.route == (Route.STREAM if local else direct_route)
            assert same(snapshot(a.model), pushed(learner, torch.bfloat16))
            assert a.receiver.bases.version == version(5)
    finally:
        a.stop()
        b.stop()


def test_a_tensor_whose_delta_would_be_larger_is_sent_whole(generator, learner):
    with pusher(routes=(Route.STREAM,), dtype="bfloat16", delta=True) as by:
        assert push(by, learner.state_dict(), 1, generator).status == "ok"
        names = list(learner.state_dict())
        moved, still = names[1], names[2]
        with torch.no_grad():
            learner.state_dict()[moved].add_(1.0)  # every element changes
        prepared = by.prepare(learner.state_dict(), version(2))
        sent = {t.name: t for t in by.deltas.version(prepared, [generator.address]).delta.tensors}
        assert sent[moved].delta is None
        assert sent[moved].data.nbytes == learner.state_dict()[moved].numel() * 2
        assert sent[still].delta is not None and sent[still].delta.elements == 0
        (outcome,) = by.send(prepared, [generator.target_id])
        assert (outcome.status, outcome.encoding) == ("ok", "delta")
        assert outcome.bytes == learner.state_dict()[moved].numel() * 2
        assert same(snapshot(generator.model), pushed(learner, torch.bfloat16))


def _corrupt_a_value(push: Snapshot) -> Snapshot:
    """The first delta tensor's last value changed, its checksum (the resulting tensor's) kept."""
    tensors = list(push.tensors)
    i = next((i for i, t in enumerate(tensors) if t.delta is not None and t.delta.elements), None)
    if i is None:  # a full push: sent as it is
        return push
    payload = tensors[i].tensor.clone()
    payload[-1] ^= 0x40
    tensors[i] = dataclasses.replace(tensors[i], data=memoryview(payload.numpy()), tensor=payload)
    return dataclasses.replace(push, tensors=tensors)


def test_a_corrupted_delta_is_refused_and_the_old_version_serves(learner, direct_route):
    gen = Generator(data=direct_route == Route.DATA)
    access = ClientAccess(TOKEN)
    faulty = Faulty(sender(direct_route, access), Fault(Reason.BAD_CHECKSUM, "corrupt", _corrupt_a_value))
    fallback = [StreamSender(CHUNK)] if direct_route != Route.STREAM else []
    try:
        with WeightPusher(access, chunk_bytes=CHUNK, dtype="bfloat16", delta=True,
                          route_senders=[faulty, *fallback]) as by:
            assert push(by, learner.state_dict(), 1, gen).status == "ok"
            served = snapshot(gen.model)
            train_step(learner, seed=2)
            refused = push(by, learner.state_dict(), 2, gen)
            assert (refused.status, refused.reason) == ("rejected", Reason.BAD_CHECKSUM), refused.detail
            assert same(snapshot(gen.model), served)
            assert gen.receiver.version == version(1) and gen.receiver.bases.version == version(1)
            # the learner no longer counts on the generator's base: the next version goes whole, and lands
            train_step(learner, seed=3)
            outcome = push(by, learner.state_dict(), 3, gen)
            assert (outcome.status, outcome.encoding) == ("ok", "full")
            assert same(snapshot(gen.model), pushed(learner, torch.bfloat16))
    finally:
        gen.stop()


def test_a_relay_forwards_the_delta_applied_whole(learner):
    child = Generator(seed=3, data=False)
    parent = Generator(seed=4, data=False, relay=Relay(relay_pusher(ClientAccess(TOKEN), CHUNK, 30.0)))
    try:
        with pusher(routes=(Route.STREAM,), dtype="bfloat16", delta=True) as by:
            tree = RelayPlan({parent.target_id: [child.target_id]}, 1)
            for step in (1, 2):
                train_step(learner, seed=step)
                prepared = by.prepare(learner.state_dict(), version(step))
                (outcome,) = by.send(prepared, [parent.target_id], tree)
                assert (outcome.status, outcome.encoding) == ("ok", "full" if step == 1 else "delta")
                deadline = time.monotonic() + 30
                while child.receiver.version != version(step):
                    assert time.monotonic() < deadline, "the relay did not finish"
                    time.sleep(0.01)
            for gen in (parent, child):
                assert same(snapshot(gen.model), pushed(learner, torch.bfloat16))
            assert child.receiver.bases is None  # relayed whole, kept as no base
    finally:
        parent.stop()
        child.stop()



def test_collective_members_get_each_version_whole(learner):
    """One broadcast serves every member of a round, so a delta pusher sends its collective targets the
    version whole (and asks them to keep it)."""
    gens = [Generator(seed=i, data=False, collective=True) for i in range(2)]
    sender = CollectiveSender(bucket_bytes=BUCKET, timeout_s=20.0)
    try:
        with WeightPusher(ClientAccess(TOKEN), chunk_bytes=CHUNK, timeout_s=30, dtype="bfloat16", delta=True,
                          route_senders=[sender, StreamSender(CHUNK)]) as by:
            for step in (1, 2):
                train_step(learner, seed=step)
                outcomes = by.push(learner.state_dict(), version(step), [g.target_id for g in gens])
                assert [(o.status, o.route, o.encoding) for o in outcomes] == \
                    [("ok", Route.COLLECTIVE, "full")] * 2, outcomes
        assert all(same(snapshot(g.model), pushed(learner, torch.bfloat16)) for g in gens)
    finally:
        for g in gens:
            g.stop()

"""Adding a route is one module that registers it: this one. A toy route, the tensor bytes handed over in this
process's memory (a mailbox both ends share) while gRPC carries each tensor's control message and the commit,
is registered here and nowhere else, and a version goes through it end to end over real gRPC: taken by the
pusher's routing, read by the receiver's sources, verified by the receiver's checks like any route's."""

from __future__ import annotations

import dataclasses
import threading
from collections.abc import Iterator
from contextlib import nullcontext

import grpc
import numpy as np
import pytest
import xxhash

from asyncrlhf._proto import weights_pb2 as pb
from asyncrlhf.weights.access import PushCall
from asyncrlhf.weights.codec import Snapshot, copy_hashed, prepare, tensor_header
from asyncrlhf.weights.pusher import PushStatus
from asyncrlhf.weights.routes import RouteSpec, SenderSettings, register, registered, unregister
from asyncrlhf.weights.vocabulary import Reason, Route
from tests.integration.weights.helpers import Generator, pusher, same, snapshot, tiny_model, version

pytestmark = pytest.mark.integration

TOY = Route("toy")


class Mailbox:
    """Tensor bytes by (lineage, step, name), put by the learner end, taken by the generator end."""

    def __init__(self) -> None:
        self.letters: dict[tuple[int, int, str], memoryview] = {}
        self.taken = 0
        self.lock = threading.Lock()

    def put(self, header: pb.WeightChunk, data: memoryview) -> None:
        with self.lock:
            self.letters[(header.lineage, header.version, header.name)] = data

    def holds(self, header: pb.WeightChunk) -> bool:
        with self.lock:
            return (header.lineage, header.version, header.name) in self.letters

    def take(self, header: pb.WeightChunk) -> memoryview:
        with self.lock:
            self.taken += 1
            return self.letters.pop((header.lineage, header.version, header.name))


MAILBOX = Mailbox()


class Letter:
    """One tensor's bytes out of the mailbox (a `routes.Bytes` payload)."""

    def __init__(self, data: memoryview):
        self.data, self.nbytes = data, len(data)

    def copy_into(self, dst: np.ndarray, digest: xxhash.xxh3_64) -> None:
        copy_hashed(dst, self.data, digest)

    def abort(self) -> None:
        """Nothing to stop: the bytes are here."""


class ToySource:
    route = TOY

    def __init__(self, mailbox: Mailbox):
        self.mailbox = mailbox

    def payload(self, header: pb.WeightChunk, inline: memoryview) -> Letter:
        return Letter(self.mailbox.take(header))


class ToyTransfer:
    def __init__(self, push: Snapshot):
        self.push = push

    def messages(self, commit: bytes) -> Iterator[bytes]:
        for t in self.push.tensors:
            checksum = t.checksum if t.checksum is not None else xxhash.xxh3_64_intdigest(t.data)
            header = tensor_header(self.push.version, t, checksum=checksum)
            MAILBOX.put(header, t.data)
            yield header.SerializeToString()
        yield commit

    def send_weights(self, call: PushCall, address: str, commit: bytes) -> pb.PushReply:
        return call(self.messages(commit))

    def close(self) -> None:
        """Nothing is kept."""


class ToySender:
    route = TOY

    def accepts(self, address: str, status: pb.GetStatusReply) -> bool:
        return True

    def forget(self, address: str) -> None:
        """Nothing is kept per generator."""

    def begin(self, push: Snapshot, targets: int) -> ToyTransfer:
        return ToyTransfer(push)

    def close(self) -> None:
        """Nothing is kept across rounds."""


def _sender(settings: SenderSettings) -> ToySender:
    return ToySender()


def _source(mailbox: Mailbox) -> nullcontext[ToySource]:
    return nullcontext(ToySource(mailbox))


@pytest.fixture
def toy():
    """The toy route, registered for one test (preferred to every built-in route)."""
    register(RouteSpec(TOY, _sender, lambda header: not header.commit and MAILBOX.holds(header), _source,
                       preference=0, standing=lambda: MAILBOX))
    yield TOY
    unregister(TOY)


def test_a_version_goes_end_to_end_over_a_route_registered_in_one_module(toy):
    assert registered()[0].route == toy
    gen = Generator(data=False)
    try:
        learner = tiny_model(seed=5)
        with pusher(routes=(toy,)) as by:
            (outcome,) = by.send(Snapshot(version(1), prepare(learner.state_dict())), [gen.target_id])
            assert (outcome.status, outcome.route) == (PushStatus.OK, toy), outcome.detail
            assert same(snapshot(gen.model), snapshot(learner)) and gen.receiver.version == version(1)
            assert MAILBOX.taken == len(learner.state_dict()) and not MAILBOX.letters  # every byte came by it

            push = Snapshot(version(2), prepare(tiny_model(seed=6).state_dict()))
            corrupt = dataclasses.replace(push.tensors[1], checksum=(push.tensors[1].checksum or 0) ^ 1)
            bad = dataclasses.replace(push, tensors=[push.tensors[0], corrupt, *push.tensors[2:]])
            (refused,) = by.send(bad, [gen.target_id])
            assert (refused.status, refused.reason, refused.code) == (
                PushStatus.REJECTED, Reason.BAD_CHECKSUM, grpc.StatusCode.DATA_LOSS)
            assert same(snapshot(gen.model), snapshot(learner)) and gen.receiver.version == version(1)
    finally:
        MAILBOX.letters.clear()
        gen.stop()

"""The data channel over real sockets and real gRPC: bytes beside the call, every failure a refused push (the
old version serving), the pusher falling back to the gRPC stream where the channel cannot be used."""

from __future__ import annotations

import socket
import threading
import time

import grpc
import pytest
import xxhash

from asyncrlhf._proto import weights_pb2 as pb
from asyncrlhf.weights import channel_read
from asyncrlhf.weights.access import AUTH_METADATA_KEY, GRPC_OPTIONS
from asyncrlhf.weights.channel import Outgoing, control_messages, new_ticket, split_address
from asyncrlhf.weights.channel_read import DataListener
from asyncrlhf.weights.codec import Snapshot, commit_message, prepare
from asyncrlhf.weights.pusher import PushTarget
from asyncrlhf.weights.relay import TreePush
from asyncrlhf.weights.vocabulary import Reason, Route, refusal_reason
from tests.integration.weights.helpers import (
    ONLY,
    TOKEN,
    Generator,
    push,
    pusher,
    same,
    snapshot,
    tiny_model,
    version,
)

pytestmark = pytest.mark.integration


def across_hosts():
    """A pusher as across hosts: no shared memory; the data channel, else the stream."""
    return pusher(routes=ONLY[Route.DATA])


def pushed(model) -> Snapshot:
    return Snapshot(version(1), prepare(model.state_dict()))


def by_hand(gen: Generator, push: Snapshot, send, *, port: int | None = None,
            connect: bool = True) -> grpc.RpcError | pb.PushReply:
    """A data-channel push written out: the control messages over gRPC, and `send(sock, tensors)` writing
    the connection's bytes (the ticket already sent) to `port` (the receiver's data port unless given)."""
    ticket = new_ticket()
    port = port if port is not None else gen.data.port
    outgoing = Outgoing("127.0.0.1", port, ticket, 10) if connect else None
    sender = threading.Thread(target=lambda: outgoing and send(outgoing.sock, push.tensors), daemon=True)
    sender.start()
    requests = [*control_messages(push, ticket), commit_message(push).SerializeToString()]
    with grpc.insecure_channel(gen.address, options=GRPC_OPTIONS) as ch:
        call = ch.stream_unary("/asyncrlhf.v1.WeightSync/PushWeights",
                               response_deserializer=pb.PushReply.FromString)
        try:
            return call(iter(requests), timeout=30, metadata=((AUTH_METADATA_KEY, f"Bearer {TOKEN}"),))
        except grpc.RpcError as err:
            return err
        finally:
            if outgoing is not None:
                outgoing.close()
            sender.join(10)


def honest(sock: socket.socket, tensors) -> None:
    for t in tensors:
        sock.sendall(t.data)
        sock.sendall(xxhash.xxh3_64_intdigest(t.data).to_bytes(8, "little"))


def refused(result, reason: Reason) -> bool:
    return isinstance(result, grpc.RpcError) and refusal_reason(result) == reason


def test_a_push_goes_over_the_data_channel_bit_exact_and_again(generator):
    learner = tiny_model(0)
    with across_hosts() as by:
        assert by.probe([PushTarget("g0", generator.address)]) == [Route.DATA]
        assert by.get_status(generator.address).data_port == generator.data.port
        outcome = push(by, learner.state_dict(), 1, generator)
        assert (outcome.status, outcome.version, outcome.route) == ("ok", version(1), Route.DATA)
        assert outcome.bytes == sum(t.numel() * 4 for t in learner.state_dict().values())
        assert same(snapshot(generator.model), snapshot(learner))
        other = tiny_model(7)  # the second push stages into the buffers the first one left
        assert push(by, other.state_dict(), 2, generator).status == "ok"
        assert same(snapshot(generator.model), snapshot(other))


def test_the_hand_written_push_is_accepted(generator):
    """The protocol as written in the proto: what the failure cases below change one thing of."""
    learner = tiny_model(0)
    reply = by_hand(generator, pushed(learner), honest)
    assert isinstance(reply, pb.PushReply) and reply.version == 1
    assert same(snapshot(generator.model), snapshot(learner))


def cut_mid_tensor(sock, tensors) -> None:
    honest(sock, tensors[:2])
    sock.sendall(tensors[2].data[:100])
    sock.shutdown(socket.SHUT_WR)


def test_a_connection_that_breaks_mid_tensor_is_truncated_and_the_old_version_serves(generator):
    before = snapshot(generator.model)
    result = by_hand(generator, pushed(tiny_model(0)), cut_mid_tensor)
    assert refused(result, Reason.TRUNCATED) and "broke mid-tensor" in result.details(), result
    assert same(snapshot(generator.model), before) and generator.receiver.version.step == 0


def test_a_ticket_whose_connection_never_comes_is_refused_in_time():
    gen = Generator(data=False)
    gen.receiver.ends[Route.DATA] = gen.data = DataListener(claim_timeout_s=0.5)
    try:
        start = time.monotonic()
        result = by_hand(gen, pushed(tiny_model(0)), honest, connect=False)
        assert refused(result, Reason.CHANNEL_UNAVAILABLE), result
        assert time.monotonic() - start < 5 and gen.receiver.version.step == 0
    finally:
        gen.stop()


def test_a_receiver_without_a_channel_refuses_a_ticket():
    gen = Generator(data=False)
    elsewhere = DataListener()  # somewhere to connect to: not the receiver's
    try:
        with across_hosts() as by:
            assert by.get_status(gen.address).data_port == 0
        result = by_hand(gen, pushed(tiny_model(0)), honest, port=elsewhere.port)
        assert refused(result, Reason.CHANNEL_UNAVAILABLE), result
    finally:
        elsewhere.close()
        gen.stop()


def test_connections_with_a_wrong_or_no_ticket_are_closed_and_pair_with_nothing():
    listener = DataListener(claim_timeout_s=0.5)
    try:
        silent = socket.create_connection(("127.0.0.1", listener.port), timeout=5)
        stranger = Outgoing("127.0.0.1", listener.port, new_ticket(), 5)
        assert silent.recv(1) == b""  # closed: no ticket within the claim timeout
        with pytest.raises(Exception, match="channel_unavailable"):
            listener.claim(new_ticket())  # the stranger's ticket is not this one
        stranger.close()
        silent.close()
    finally:
        listener.close()


def test_a_data_port_that_refuses_connections_gets_the_byte_stream_then_is_asked_again(generator):
    learner = tiny_model(0)
    with across_hosts() as by:
        assert by.probe([PushTarget("g0", generator.address)]) == [Route.DATA]
        generator.data.close()  # the port closes; the gRPC server stays
        outcome = push(by, learner.state_dict(), 1, generator)
        assert (outcome.status, outcome.route) == ("ok", Route.STREAM)
        assert same(snapshot(generator.model), snapshot(learner))
        # a restarted channel, on another port
        generator.receiver.ends[Route.DATA] = generator.data = DataListener()
        assert by.probe([PushTarget("g0", generator.address)]) == [Route.DATA]  # asked again
        outcome = push(by, tiny_model(3).state_dict(), 2, generator)
        assert (outcome.status, outcome.route) == ("ok", Route.DATA)


def test_a_receiver_that_refuses_mid_push_ends_the_pushers_sending(generator):
    """The receiver stops reading at a refused tensor; the pusher's sender, blocked on a full socket, is
    woken and the push reported rejected, no thread left behind."""
    with across_hosts() as by:
        big = tiny_model(0).state_dict()
        name = next(n for n in big if n.endswith("q_proj.weight"))
        big[name] = big[name].repeat(4096, 1)  # 64 MiB: more than the socket holds, and the wrong shape
        outcome = push(by, big, 1, generator)
        assert (outcome.status, outcome.reason) == ("rejected", Reason.SHAPE_MISMATCH), outcome
    assert not [t for t in threading.enumerate() if t.name == "weight-data-send"]
    assert generator.receiver.version.step == 0


def test_a_pusher_silent_mid_tensor_is_given_up_on(monkeypatch, generator):
    monkeypatch.setattr(channel_read, "IDLE_TIMEOUT_S", 0.5)
    done = threading.Event()

    def stall(sock, tensors):
        sock.sendall(tensors[0].data[:10])
        done.wait(10)

    try:
        result = by_hand(generator, pushed(tiny_model(0)), stall)
    finally:
        done.set()
    assert refused(result, Reason.TRUNCATED), result
    assert "silent" in result.details() and generator.receiver.version.step == 0


def test_relays_forward_over_the_data_channel():
    gens = [Generator(seed=i + 1, data=True) for i in range(3)]
    learner = tiny_model(0)
    try:
        targets = [PushTarget(f"g{i}", g.address) for i, g in enumerate(gens)]
        with across_hosts() as by:
            outcomes = TreePush(by, by.prepare(learner.state_dict(), version(1)), 1).run(targets)
        assert [o.status for o in outcomes] == ["ok"] * 3
        assert [o.relayed_by for o in outcomes] == ["", "g0", "g1"]
        assert [o.route for o in outcomes] == [Route.DATA, Route.RELAY, Route.RELAY]
        assert all(same(snapshot(g.model), snapshot(learner)) for g in gens)
    finally:
        for g in gens:
            g.stop()


def test_split_address():
    assert split_address("10.0.0.5:50051") == "10.0.0.5"
    assert split_address("[::1]:50051") == "::1"
    assert split_address("generator:50051") == "generator"

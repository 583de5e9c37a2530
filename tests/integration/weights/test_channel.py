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
from asyncrlhf._proto import weights_pb2_grpc as pb_grpc
from asyncrlhf.weights import channel
from asyncrlhf.weights import pusher as pusher_module
from asyncrlhf.weights.channel import DataListener, Outgoing, control_messages, new_ticket, split_address
from asyncrlhf.weights.codec import commit_message, prepare
from asyncrlhf.weights.pusher import PushTarget, WeightPusher
from asyncrlhf.weights.server import AUTH_METADATA_KEY, GRPC_OPTIONS, serve
from tests.integration.weights.helpers import CHUNK, TOKEN, Generator, push, same, snapshot, tiny_model

pytestmark = pytest.mark.integration


@pytest.fixture(autouse=True)
def across_hosts(monkeypatch):
    monkeypatch.setattr(pusher_module, "shm_host", lambda: "")  # as across hosts: no shared memory


@pytest.fixture
def generator():
    gen = Generator(data=True)
    yield gen
    gen.stop()


def by_hand(gen: Generator, tensors, version: int, send, *, ticket: bytes | None = None,
            connect: bool = True) -> grpc.RpcError | pb.PushReply:
    """A data-channel push written out: the control messages over gRPC, and `send(sock, tensors)` writing
    the connection's bytes (the ticket already sent)."""
    ticket = ticket or new_ticket()
    outgoing = Outgoing("127.0.0.1", gen.data.port, ticket, 10) if connect else None
    sender = threading.Thread(target=lambda: outgoing and send(outgoing.sock, tensors), daemon=True)
    sender.start()
    requests = [*control_messages(tensors, version, 0, ticket),
                commit_message(version, 0, len(tensors), False).SerializeToString()]
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


def refused(result, code: grpc.StatusCode, reason: str) -> bool:
    return isinstance(result, grpc.RpcError) and result.code() == code and result.details().startswith(reason)


def test_a_push_goes_over_the_data_channel_bit_exact_and_again(generator):
    learner = tiny_model(0)
    with WeightPusher(TOKEN, chunk_bytes=CHUNK) as pusher:
        assert pusher.paths([PushTarget("g0", generator.address)]) == ["data"]
        assert pusher.get_status(generator.address).data_port == generator.data.port
        outcome = push(pusher, learner.state_dict(), 1, generator)
        assert (outcome.status, outcome.version) == ("ok", 1), outcome.detail
        assert outcome.bytes == sum(t.numel() * 4 for t in learner.state_dict().values())
        assert same(snapshot(generator.model), snapshot(learner))
        other = tiny_model(7)  # the second push stages into the buffers the first one left
        assert push(pusher, other.state_dict(), 2, generator).status == "ok"
        assert same(snapshot(generator.model), snapshot(other))


def test_the_hand_written_push_is_accepted(generator):
    """The protocol as written in the proto: what the failure cases below change one thing of."""
    learner = tiny_model(0)
    reply = by_hand(generator, prepare(learner.state_dict()), 1, honest)
    assert isinstance(reply, pb.PushReply) and reply.version == 1
    assert same(snapshot(generator.model), snapshot(learner))


def wrong_trailer(sock, tensors) -> None:
    for i, t in enumerate(tensors):
        sock.sendall(t.data)
        digest = xxhash.xxh3_64_intdigest(t.data) ^ (i == 3)
        sock.sendall(digest.to_bytes(8, "little"))


def flipped_byte(sock, tensors) -> None:
    for i, t in enumerate(tensors):
        data = bytearray(t.data)
        sock.sendall(data[:-1] + bytes([data[-1] ^ (i == 2)]))
        sock.sendall(xxhash.xxh3_64_intdigest(t.data).to_bytes(8, "little"))


def cut_mid_tensor(sock, tensors) -> None:
    honest(sock, tensors[:2])
    sock.sendall(tensors[2].data[:100])
    sock.shutdown(socket.SHUT_WR)


@pytest.mark.parametrize("send, code, reason", [
    (wrong_trailer, grpc.StatusCode.DATA_LOSS, "bad_checksum"),
    (flipped_byte, grpc.StatusCode.DATA_LOSS, "bad_checksum"),
    (cut_mid_tensor, grpc.StatusCode.DATA_LOSS, "truncated"),
])
def test_bad_bytes_on_the_channel_are_refused_and_the_old_version_serves(generator, send, code, reason):
    before = snapshot(generator.model)
    result = by_hand(generator, prepare(tiny_model(0).state_dict()), 1, send)
    assert refused(result, code, reason), result
    assert same(snapshot(generator.model), before) and generator.receiver.version == 0
    learner = tiny_model(0)  # and the next push goes through
    assert by_hand(generator, prepare(learner.state_dict()), 2, honest).version == 2
    assert same(snapshot(generator.model), snapshot(learner))


def test_a_ticket_whose_connection_never_comes_is_refused_in_time():
    gen = Generator(data=False)
    gen.data = DataListener(claim_timeout_s=0.5)
    gen.server.stop(0)
    gen.server, gen.port = serve(gen.receiver, token=TOKEN, data=gen.data)
    gen.address = f"127.0.0.1:{gen.port}"
    try:
        start = time.monotonic()
        result = by_hand(gen, prepare(tiny_model(0).state_dict()), 1, honest, connect=False)
        assert refused(result, grpc.StatusCode.FAILED_PRECONDITION, "channel_unavailable"), result
        assert time.monotonic() - start < 5 and gen.receiver.version == 0
    finally:
        gen.stop()


def test_a_receiver_without_a_channel_refuses_a_ticket():
    gen = Generator(data=False)
    try:
        with WeightPusher(TOKEN) as pusher:
            assert pusher.get_status(gen.address).data_port == 0
        outgoing_port = DataListener()  # somewhere to connect to: not the receiver's
        gen.data = outgoing_port
        result = by_hand(gen, prepare(tiny_model(0).state_dict()), 1, honest)
        assert refused(result, grpc.StatusCode.FAILED_PRECONDITION, "channel_unavailable"), result
        outgoing_port.close()
        gen.data = None
    finally:
        gen.stop()


def test_a_push_naming_two_tickets_is_refused(generator):
    tensors = prepare(tiny_model(0).state_dict())
    ticket, other = new_ticket(), new_ticket()
    requests = [*control_messages(tensors[:1], 1, 0, ticket), *control_messages(tensors[1:], 1, 0, other),
                commit_message(1, 0, len(tensors), False).SerializeToString()]
    outgoing = Outgoing("127.0.0.1", generator.data.port, ticket, 10)
    try:
        stub = pb_grpc.WeightSyncStub(grpc.insecure_channel(generator.address, options=GRPC_OPTIONS))
        with pytest.raises(grpc.RpcError) as err:
            stub.PushWeights(iter(pb.WeightChunk.FromString(r) for r in requests), timeout=30,
                             metadata=((AUTH_METADATA_KEY, f"Bearer {TOKEN}"),))
        assert err.value.code() == grpc.StatusCode.FAILED_PRECONDITION
        assert err.value.details().startswith("channel_unavailable")
    finally:
        outgoing.close()
    assert generator.receiver.version == 0


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
    with WeightPusher(TOKEN, chunk_bytes=CHUNK) as pusher:
        assert pusher.paths([PushTarget("g0", generator.address)]) == ["data"]
        generator.data.close()  # the port closes; the gRPC server stays
        outcome = push(pusher, learner.state_dict(), 1, generator)
        assert outcome.status == "ok" and same(snapshot(generator.model), snapshot(learner))
        generator.data = DataListener()  # a restarted channel, on another port
        generator.server.stop(0)
        generator.server, port = serve(generator.receiver, port=generator.port, token=TOKEN,
                                       data=generator.data)
        assert pusher.paths([PushTarget("g0", generator.address)]) == ["data"]  # asked again
        assert push(pusher, tiny_model(3).state_dict(), 2, generator).status == "ok"


def test_a_receiver_that_refuses_mid_push_ends_the_pushers_sending(generator):
    """The receiver stops reading at a refused tensor; the pusher's sender, blocked on a full socket, is
    woken and the push reported rejected, no thread left behind."""
    with WeightPusher(TOKEN, chunk_bytes=CHUNK) as pusher:
        big = tiny_model(0).state_dict()
        name = next(n for n in big if n.endswith("q_proj.weight"))
        big[name] = big[name].repeat(4096, 1)  # 64 MiB: more than the socket holds, and the wrong shape
        outcome = push(pusher, big, 1, generator)
        assert outcome.status == "rejected" and outcome.detail.startswith("shape_mismatch"), outcome
    assert not [t for t in threading.enumerate() if t.name == "weight-data-send"]
    assert generator.receiver.version == 0


def test_a_pusher_silent_mid_tensor_is_given_up_on(monkeypatch, generator):
    monkeypatch.setattr(channel, "IDLE_TIMEOUT_S", 0.5)
    done = threading.Event()

    def stall(sock, tensors):
        sock.sendall(tensors[0].data[:10])
        done.wait(10)

    try:
        result = by_hand(generator, prepare(tiny_model(0).state_dict()), 1, stall)
    finally:
        done.set()
    assert refused(result, grpc.StatusCode.DATA_LOSS, "truncated"), result
    assert "silent" in result.details() and generator.receiver.version == 0


def test_relays_forward_over_the_data_channel():
    gens = [Generator(seed=i + 1, data=True) for i in range(3)]
    learner = tiny_model(0)
    try:
        targets = [PushTarget(f"g{i}", g.address) for i, g in enumerate(gens)]
        with WeightPusher(TOKEN, chunk_bytes=CHUNK, relay_fanout=1) as pusher:
            outcomes = pusher.push(learner.state_dict(), 1, targets)
        assert [o.status for o in outcomes] == ["ok"] * 3
        assert [o.relayed_by for o in outcomes] == ["", "g0", "g1"]
        assert [o.path for o in outcomes] == ["data", "relay", "relay"]
        assert all(same(snapshot(g.model), snapshot(learner)) for g in gens)
    finally:
        for g in gens:
            g.stop()


def test_split_address():
    assert split_address("10.0.0.5:50051") == "10.0.0.5"
    assert split_address("[::1]:50051") == "::1"
    assert split_address("generator:50051") == "generator"

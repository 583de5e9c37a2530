"""The two halves of a collective round received by an inference engine's worker (`engine_member.py`), on
their own: a worker's refusal read back across vLLM's RPC, what the generator asks the worker for, a client
without the worker's key, and peers that stall on the control line (its real socket)."""

from __future__ import annotations

import secrets
import socket
import struct
import threading
import time

import pytest
import torch

from asyncrlhf._proto import weights_pb2 as pb
from asyncrlhf.sampling.hops import engine_member
from asyncrlhf.sampling.hops.engine_member import EngineMember, WorkerRounds, refusal, tagged
from asyncrlhf.sampling.hops.line import Line, listener
from asyncrlhf.weights.vocabulary import PushRejected, Reason


def test_a_workers_refusal_keeps_its_reason_across_the_rpc():
    sent = PushRejected(Reason.BAD_CHECKSUM, "`w`: XXH3-64 0x1 in the worker, expected 0x2")
    # vLLM re-raises a worker's error as text inside its own message
    got = refusal(RuntimeError(f"Call to collective_rpc method failed: {tagged(sent)}"))
    assert got.reason == Reason.BAD_CHECKSUM and "expected 0x2" in str(got)
    assert str(got).startswith("bad_checksum: ")  # as every refusal's detail starts
    assert refusal(RuntimeError("worker died")).reason == Reason.COLLECTIVE_UNAVAILABLE


@pytest.fixture
def rounds():
    worker = WorkerRounds("cpu", b"k" * 16)
    yield worker
    worker.close()


def test_the_generator_asks_the_worker_only_for_placeholders_of_its_last_round(rounds):
    member = EngineMember(rounds.address, b"k" * 16, rounds.backends)
    try:
        assert member.held({"w": torch.zeros(2)}) is None  # bytes here: the target loads them itself
        with pytest.raises(PushRejected, match="all by the collective route or none"):
            member.held({"w": torch.zeros(2), "v": torch.empty(2, device="meta")})
        with pytest.raises(PushRejected, match="not the last round's") as refused:
            member.held({"v": torch.empty(2, device="meta")})  # no round joined yet
        assert refused.value.reason == Reason.COLLECTIVE_UNAVAILABLE
    finally:
        member.close()


def test_a_client_without_the_workers_key_is_refused_and_the_worker_serves_on(rounds):
    slot = pb.CollectiveSlot(backend="nccl")  # a backend the CPU worker does not offer: refused there
    stranger = EngineMember(rounds.address, secrets.token_bytes(16), ("nccl",))
    with pytest.raises(PushRejected, match="cannot be reached") as refused:
        stranger.round(slot)
    assert refused.value.reason == Reason.COLLECTIVE_UNAVAILABLE
    member = EngineMember(rounds.address, b"k" * 16, ("nccl",))  # the key: the worker answers
    try:
        with pytest.raises(PushRejected, match="not one this receiver offers") as refused:
            member.round(slot)
        assert refused.value.reason == Reason.COLLECTIVE_UNAVAILABLE
    finally:
        member.close()


def test_a_peer_that_connects_and_stalls_holds_up_no_other_connection(rounds):
    """A connection that never answers the key challenge (stopped, wedged, a stranger) waits on a thread of
    its own: the generator's requests are still answered."""
    stalled = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    stalled.connect(rounds.address)
    member = EngineMember(rounds.address, b"k" * 16, ("nccl",))
    answered: list[PushRejected] = []

    def ask() -> None:
        with pytest.raises(PushRejected) as refused:
            member.round(pb.CollectiveSlot(backend="nccl"))
        answered.append(refused.value)

    try:
        asking = threading.Thread(target=ask, daemon=True)
        asking.start()
        asking.join(30)
        assert [str(r) for r in answered] == [
            "collective_unavailable: backend 'nccl' is not one this receiver offers (gloo)"]
    finally:
        stalled.close()
        if not asking.is_alive():  # else it holds the member's lock: closing would wait for it
            member.close()


def test_a_worker_that_stops_answering_fails_that_round_and_the_next_dials_again(monkeypatch):
    """The worker's end of the line accepts and proves the key, then never answers the first request: the
    round is refused (`collective_unavailable`, saying so) within the join's timeout, not waited on for ever;
    the next round dials a new line and is answered."""
    monkeypatch.setattr(engine_member, "JOIN_TIMEOUT_S", 0.5)
    key, address = b"k" * 16, f"\0asyncrlhf-test-{secrets.token_hex(8)}"
    server = listener(address)

    def worker() -> None:
        with Line(server.accept()[0]).accepted(key) as first:
            first.recv_bytes(idle=True)
            time.sleep(3)  # stalled: no answer
        with Line(server.accept()[0]).accepted(key) as second:
            second.recv_bytes(idle=True)
            second.send_bytes(b"")  # joined

    threading.Thread(target=worker, daemon=True).start()
    member = EngineMember(address, key, ("gloo",))
    try:
        with pytest.raises(PushRejected, match="did not answer for round 1") as refused:
            member.round(pb.CollectiveSlot(backend="gloo", round=1))
        assert refused.value.reason == Reason.COLLECTIVE_UNAVAILABLE
        assert member.round(pb.CollectiveSlot(backend="gloo", round=2)).slot.round == 2
    finally:
        member.close()
        server.close()


def test_a_message_begun_and_not_finished_in_time_fails_the_line():
    ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
    with Line(ours, timeout_s=0.3) as line, theirs:
        theirs.sendall(struct.pack("!I", 100) + b"x" * 10)  # 10 of the 100 bytes it announced
        with pytest.raises(TimeoutError, match="10 of 100 bytes"):
            line.recv_bytes(idle=True)

"""The two halves of a collective round received by an inference engine's worker (`engine_member.py`), on
their own: a worker's refusal read back across vLLM's RPC, what the generator asks the worker for, and a
client without the worker's key."""

from __future__ import annotations

import secrets

import pytest
import torch

from asyncrlhf._proto import weights_pb2 as pb
from asyncrlhf.weights.engine_member import EngineMember, WorkerRounds, refusal, tagged
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

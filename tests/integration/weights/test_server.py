"""The WeightSync server over real gRPC: every rejection maps to its status code and keeps the old weights
serving bit for bit; the token is required; a public bind needs one."""

from __future__ import annotations

import grpc
import pytest

from asyncrlhf._proto import weights_pb2 as pb
from asyncrlhf._proto import weights_pb2_grpc as pb_grpc
from asyncrlhf.weights.codec import chunks, prepare
from asyncrlhf.weights.pusher import WeightPusher
from asyncrlhf.weights.server import serve
from tests.integration.weights.helpers import CHUNK, TOKEN, push, same, snapshot, tiny_model

pytestmark = pytest.mark.integration


def good_stream(learner, version: int = 2) -> list[pb.WeightChunk]:
    return list(chunks(prepare(learner.state_dict()), version, CHUNK))


def first_of(messages, name_suffix: str) -> int:
    return next(i for i, m in enumerate(messages) if m.name.endswith(name_suffix))


def rename(messages):
    messages[0].name = "model.layers.9.mlp.up_proj.weight"
    return messages


def reshape(messages):
    i = first_of(messages, "q_proj.weight")
    for m in messages:
        if m.name == messages[i].name:
            m.shape[:] = [32, 128]
    return messages


def retype(messages):
    for m in messages:
        if m.name == messages[0].name:
            m.dtype = pb.DTYPE_INT32
    return messages


def corrupt(messages):
    messages[1].data = bytes([messages[1].data[0] ^ 1]) + messages[1].data[1:]
    return messages


def truncate(messages):
    return messages[:-1]  # no commit


def cut_mid_tensor(messages):
    i = first_of(messages, "q_proj.weight")
    return messages[:i + 1] + [messages[-1]]  # first chunk of q_proj, then commit


def skip_chunk(messages):
    i = first_of(messages, "q_proj.weight")
    return messages[:i] + messages[i + 1:]


def drop_tensor(messages):
    name = messages[0].name
    kept = [m for m in messages if m.name != name]
    kept[-1].tensor_count -= 1
    return kept


def miscount(messages):
    messages[-1].tensor_count += 1
    return messages


def stale(messages):
    for m in messages:
        m.version = 1  # the generator already serves version 1
    return messages


REJECTIONS = [
    (rename, grpc.StatusCode.NOT_FOUND, "unknown_tensor"),
    (reshape, grpc.StatusCode.INVALID_ARGUMENT, "shape_mismatch"),
    (retype, grpc.StatusCode.INVALID_ARGUMENT, "dtype_mismatch"),
    (corrupt, grpc.StatusCode.DATA_LOSS, "bad_checksum"),
    (truncate, grpc.StatusCode.DATA_LOSS, "truncated"),
    (cut_mid_tensor, grpc.StatusCode.DATA_LOSS, "truncated"),
    (skip_chunk, grpc.StatusCode.INVALID_ARGUMENT, "bad_offset"),
    (drop_tensor, grpc.StatusCode.INVALID_ARGUMENT, "missing_tensors"),
    (miscount, grpc.StatusCode.INVALID_ARGUMENT, "tensor_count"),
    (stale, grpc.StatusCode.FAILED_PRECONDITION, "stale_version"),
]


@pytest.fixture
def served_v1(generator, learner):
    """The generator serves version 1 (the learner's weights); returns its exact state."""
    with WeightPusher(TOKEN, chunk_bytes=CHUNK) as pusher:
        assert push(pusher, learner.state_dict(), 1, generator).status == "ok"
    return snapshot(generator.model)


@pytest.mark.parametrize("tamper, code, reason", REJECTIONS,
                         ids=[f"{reason}:{tamper.__name__}" for tamper, _, reason in REJECTIONS])
def test_rejected_push_keeps_serving_the_old_version(generator, served_v1, tamper, code, reason):
    new = tiny_model(seed=7)  # different weights, so a partial apply would show
    messages = tamper(good_stream(new))
    stub = pb_grpc.WeightSyncStub(grpc.insecure_channel(generator.address))
    auth = (("authorization", f"Bearer {TOKEN}"),)
    with pytest.raises(grpc.RpcError) as err:
        stub.PushWeights(iter(messages), timeout=30, metadata=auth)
    assert err.value.code() == code
    assert err.value.details().startswith(reason), err.value.details()
    assert same(snapshot(generator.model), served_v1)
    assert stub.GetStatus(pb.GetStatusRequest(), metadata=auth).version == 1


@pytest.mark.parametrize("token", [None, "wrong"], ids=["missing_token", "wrong_token"])
def test_unauthenticated_push_keeps_serving_the_old_version(generator, served_v1, token):
    with WeightPusher(token, chunk_bytes=CHUNK) as pusher:
        outcome = push(pusher, tiny_model(seed=7).state_dict(), 2, generator)
        assert (outcome.status, outcome.code) == ("rejected", "UNAUTHENTICATED")
        assert "token" in outcome.detail
    assert same(snapshot(generator.model), served_v1)
    assert generator.receiver.version == 1


def test_rejected_then_good_push_recovers(generator, served_v1):
    new = tiny_model(seed=7)
    with WeightPusher(TOKEN, chunk_bytes=CHUNK) as pusher:
        assert push(pusher, new.state_dict(), 1, generator).status == "rejected"  # stale
        assert push(pusher, new.state_dict(), 2, generator).status == "ok"
    assert same(snapshot(generator.model), snapshot(new))


def test_serve_refuses_a_public_bind_without_token(generator):
    with pytest.raises(ValueError, match="without a token"):
        serve(generator.receiver, host="0.0.0.0", token=None)

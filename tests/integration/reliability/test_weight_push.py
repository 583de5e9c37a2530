"""Every weight-push rejection driven from outside, over gRPC, against a running generator process (with a
token): each is refused with its status code, the generator keeps serving the version it had, and a valid
push still lands afterwards. The token is also required for GetStatus and for POST /v1/completions."""

from __future__ import annotations

import uuid

import grpc
import httpx
import pytest
import redis

from asyncrlhf._proto import weights_pb2 as pb
from asyncrlhf.config import load_config
from asyncrlhf.models import load_policy
from asyncrlhf.version import PolicyVersion
from asyncrlhf.weights.access import AUTH_METADATA_KEY, GRPC_OPTIONS
from asyncrlhf.weights.codec import Snapshot, chunks, prepare
from asyncrlhf.weights.vocabulary import Reason
from tests.integration.generator.helpers import START_TIMEOUT_S, GeneratorProcess, members, wait_for

pytestmark = pytest.mark.integration
TOKEN = "push-s3cret"
CHUNK = 16 << 10  # the embedding spans several chunks
SERVICE = pb.DESCRIPTOR.services_by_name["WeightSync"].full_name
CFG = load_config(["configs/tiny.yaml"])


class Target:
    """One generator process and a raw gRPC channel to its WeightSync server."""

    def __init__(self, url: str):
        self.run = f"test-push-{uuid.uuid4().hex[:8]}"
        self.client = redis.Redis.from_url(url)
        self.process = GeneratorProcess(url, self.run, f"run.token={TOKEN}")
        (member,) = wait_for(
            lambda: members(self.client, self.run),
            "the generator to register",
            START_TIMEOUT_S,
            [self.process],
        )
        self.channel = grpc.insecure_channel(member.address, options=GRPC_OPTIONS)
        self.tensors = prepare(load_policy(CFG.model).state_dict(), "float32")

    def messages(self, version: int, tensors=None) -> list[pb.WeightChunk]:
        return list(chunks(Snapshot(PolicyVersion(0, version), tensors or self.tensors), CHUNK))

    def push(self, messages, token: str | None = TOKEN):
        raws = [m if isinstance(m, bytes) else m.SerializeToString() for m in messages]
        call = self.channel.stream_unary(
            f"/{SERVICE}/PushWeights", response_deserializer=pb.PushReply.FromString
        )
        metadata = ((AUTH_METADATA_KEY, f"Bearer {token}"),) if token else ()
        return call(iter(raws), timeout=60, metadata=metadata)

    def version(self, token: str | None = TOKEN) -> int:
        call = self.channel.unary_unary(
            f"/{SERVICE}/GetStatus",
            request_serializer=pb.GetStatusRequest.SerializeToString,
            response_deserializer=pb.GetStatusReply.FromString,
        )
        metadata = ((AUTH_METADATA_KEY, f"Bearer {token}"),) if token else ()
        return call(pb.GetStatusRequest(), timeout=30, metadata=metadata).version

    def close(self) -> None:
        self.channel.close()
        self.process.stop()
        self.client.close()


@pytest.fixture(scope="module")
def target(redis_url):
    t = Target(redis_url)
    t.push(t.messages(1))  # version 1 is live before the bad pushes
    yield t
    t.close()


def first_tensor_positions(messages) -> list[int]:
    name = messages[0].name
    return [i for i, m in enumerate(messages) if m.name == name and not m.commit]


def rename(ms, name):
    for i in first_tensor_positions(ms):
        ms[i].name = name
    return ms


def set_first(ms, **fields):
    for i in first_tensor_positions(ms):
        for key, value in fields.items():
            if key == "shape":
                ms[i].ClearField("shape")
                ms[i].shape.extend(value)
            else:
                setattr(ms[i], key, value)
    return ms


def flip_a_byte(ms):
    data = bytearray(ms[0].data)
    data[0] ^= 0xFF
    ms[0].data = bytes(data)
    return ms


def duplicate_first(ms):
    first = [ms[i] for i in first_tensor_positions(ms)]
    return ms[:-1] + first + ms[-1:]


def only_first(ms, partial=False):
    commit = ms[-1]
    commit.tensor_count, commit.partial = 1, partial
    return [ms[i] for i in first_tensor_positions(ms)] + [commit]


def version_changes(ms):
    for m in ms[len(ms) // 2 :]:
        m.version += 1
    return ms


REJECTIONS = {
    # case: (build the messages from a valid push of version v, expected status, reason in the details)
    Reason.STALE_VERSION: (
        lambda t, v: t.messages(1), grpc.StatusCode.FAILED_PRECONDITION, Reason.STALE_VERSION
    ),
    "version_changes_mid_push": (
        lambda t, v: version_changes(t.messages(v)),
        grpc.StatusCode.FAILED_PRECONDITION,
        "changed mid-push",
    ),
    Reason.UNKNOWN_TENSOR: (
        lambda t, v: rename(t.messages(v), "model.no_such.weight"),
        grpc.StatusCode.NOT_FOUND,
        Reason.UNKNOWN_TENSOR,
    ),
    Reason.SHAPE_MISMATCH: (
        lambda t, v: set_first(t.messages(v), shape=[3, 3]),
        grpc.StatusCode.INVALID_ARGUMENT,
        Reason.SHAPE_MISMATCH,
    ),
    Reason.DTYPE_MISMATCH: (
        lambda t, v: set_first(t.messages(v), dtype=pb.DTYPE_INT64),
        grpc.StatusCode.INVALID_ARGUMENT,
        Reason.DTYPE_MISMATCH,
    ),
    Reason.BAD_OFFSET: (lambda t, v: t.messages(v)[1:], grpc.StatusCode.INVALID_ARGUMENT, Reason.BAD_OFFSET),
    Reason.DUPLICATE_TENSOR: (
        lambda t, v: duplicate_first(t.messages(v)),
        grpc.StatusCode.INVALID_ARGUMENT,
        Reason.DUPLICATE_TENSOR,
    ),
    Reason.TENSOR_COUNT: (
        lambda t, v: t.messages(v)[:-1] + [pb.WeightChunk(version=v, commit=True, tensor_count=1)],
        grpc.StatusCode.INVALID_ARGUMENT,
        Reason.TENSOR_COUNT,
    ),
    Reason.MISSING_TENSORS: (
        lambda t, v: only_first(t.messages(v)),
        grpc.StatusCode.INVALID_ARGUMENT,
        Reason.MISSING_TENSORS,
    ),
    Reason.BAD_CHECKSUM: (
        lambda t, v: flip_a_byte(t.messages(v)), grpc.StatusCode.DATA_LOSS, Reason.BAD_CHECKSUM
    ),
    Reason.TRUNCATED: (lambda t, v: t.messages(v)[:-1], grpc.StatusCode.DATA_LOSS, Reason.TRUNCATED),
    "undecodable_bytes": (lambda t, v: [b"\xff\xff\xff\xff"], None, ""),
}


@pytest.mark.parametrize("case", list(REJECTIONS), ids=str)
def test_a_bad_push_is_rejected_and_the_old_version_keeps_serving(target, case):
    build, code, reason = REJECTIONS[case]
    before = target.version()
    with pytest.raises(grpc.RpcError) as err:
        target.push(build(target, before + 1))
    if code is None:  # bytes that are no WeightChunk at all: refused by the deserializer, never applied
        assert err.value.code() != grpc.StatusCode.OK
    else:
        assert err.value.code() == code and reason in err.value.details(), (
            err.value.code(),
            err.value.details(),
        )
    assert target.version() == before
    target.process.check_alive()


@pytest.mark.parametrize("token", [None, "wrong"])
def test_a_push_or_status_call_without_the_right_token_is_unauthenticated(target, token):
    before = target.version()
    for call in (
        lambda: target.push(target.messages(before + 1), token=token),
        lambda: target.version(token),
    ):
        with pytest.raises(grpc.RpcError) as err:
            call()
        assert err.value.code() == grpc.StatusCode.UNAUTHENTICATED
    assert target.version() == before


def test_after_every_rejection_a_valid_push_lands_and_mutating_http_needs_the_token(target):
    before = target.version()
    assert target.push(target.messages(before + 1)).version == before + 1
    assert target.version() == before + 1
    url = f"{target.process.url}/v1/completions"
    body = {"model": "tiny", "prompt": "hi", "max_tokens": 2}
    assert httpx.post(url, json=body, timeout=60).status_code == 401
    assert (
        httpx.post(url, json=body, headers={"Authorization": "Bearer wrong"}, timeout=60).status_code == 401
    )
    reply = httpx.post(url, json=body, headers={"Authorization": f"Bearer {TOKEN}"}, timeout=60)
    assert reply.status_code == 200 and reply.json()["policy_version"] == before + 1
    for path in ("/healthz", "/readyz", "/metrics"):  # read-only routes stay open for probes and scrapes
        assert httpx.get(target.process.url + path, timeout=30).status_code == 200

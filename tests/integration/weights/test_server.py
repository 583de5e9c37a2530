"""The WeightSync server over real gRPC, beyond the route contract (test_route_contract.py): every refusal's
status code and trailing reason come from one table; a public bind needs a token."""

from __future__ import annotations

import grpc
import pytest

from asyncrlhf._proto import weights_pb2 as pb
from asyncrlhf._proto import weights_pb2_grpc as pb_grpc
from asyncrlhf.weights.access import ServerAccess
from asyncrlhf.weights.codec import Snapshot, chunks, prepare
from asyncrlhf.weights.server import STATUS, serve
from asyncrlhf.weights.vocabulary import Reason, refusal_reason
from tests.integration.weights.helpers import CHUNK, TOKEN, tiny_model, version

pytestmark = pytest.mark.integration


def test_every_reason_has_a_status_code():
    assert set(STATUS) == set(Reason)


def test_a_plain_grpc_client_reads_the_code_the_detail_and_the_trailing_reason(generator):
    """What any gRPC client sees of a refusal: the status code, details starting with the reason, and the
    reason alone in the trailing metadata."""
    messages = list(chunks(Snapshot(version(1), prepare(tiny_model(7).state_dict())), CHUNK))[:-1]
    stub = pb_grpc.WeightSyncStub(grpc.insecure_channel(generator.address))
    with pytest.raises(grpc.RpcError) as err:
        stub.PushWeights(iter(messages), timeout=30, metadata=(("authorization", f"Bearer {TOKEN}"),))
    assert err.value.code() == grpc.StatusCode.DATA_LOSS
    assert err.value.details().startswith("truncated: ")
    assert refusal_reason(err.value) == Reason.TRUNCATED
    status = stub.GetStatus(pb.GetStatusRequest(), metadata=(("authorization", f"Bearer {TOKEN}"),))
    assert status.version == 0


def test_serve_refuses_a_public_bind_without_token(generator):
    with pytest.raises(ValueError, match="without a token"):
        serve(generator.receiver, host="0.0.0.0", access=ServerAccess(None))

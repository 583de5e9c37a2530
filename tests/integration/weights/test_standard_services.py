"""The standard gRPC services on the WeightSync server, through their standard clients: the health client
(what Kubernetes gRPC probes and grpc_health_probe call) and a reflection client (what grpcurl uses)."""

from __future__ import annotations

import grpc
import pytest
from google.protobuf.descriptor_pool import DescriptorPool
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha.proto_reflection_descriptor_database import ProtoReflectionDescriptorDatabase

from asyncrlhf._proto import weights_pb2 as pb
from asyncrlhf._proto import weights_pb2_grpc as pb_grpc
from asyncrlhf.weights.access import SERVICE
from tests.integration.weights.helpers import push, pusher

pytestmark = pytest.mark.integration
SERVING, NOT_SERVING = health_pb2.HealthCheckResponse.SERVING, health_pb2.HealthCheckResponse.NOT_SERVING


def check(channel, service: str) -> int:
    request = health_pb2.HealthCheckRequest(service=service)
    return health_pb2_grpc.HealthStub(channel).Check(request, timeout=10).status


def test_health_follows_readiness_without_a_token(generator, learner):
    with grpc.insecure_channel(generator.address) as channel:
        assert check(channel, SERVICE) == SERVING  # takes pushes from the start
        assert check(channel, "") == NOT_SERVING  # no version live yet: not ready
        with pytest.raises(grpc.RpcError) as err:
            check(channel, "no.such.Service")
        assert err.value.code() == grpc.StatusCode.NOT_FOUND
        with pusher() as by:
            outcome = push(by, learner.state_dict(), 1, generator)
        assert outcome.status == "ok", outcome
        assert check(channel, "") == SERVING


def test_reflection_lists_weightsync_and_its_methods_while_weightsync_still_needs_the_token(generator):
    with grpc.insecure_channel(generator.address) as channel:
        database = ProtoReflectionDescriptorDatabase(channel)
        services = set(database.get_services())
        assert {SERVICE, "grpc.health.v1.Health", "grpc.reflection.v1alpha.ServerReflection"} <= services
        methods = {m.name for m in DescriptorPool(database).FindServiceByName(SERVICE).methods}
        assert methods == {"PushWeights", "GetStatus"}
        with pytest.raises(grpc.RpcError) as err:
            pb_grpc.WeightSyncStub(channel).GetStatus(pb.GetStatusRequest(), timeout=10)
        assert err.value.code() == grpc.StatusCode.UNAUTHENTICATED

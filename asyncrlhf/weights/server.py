"""The WeightSync gRPC surface: the servicer mapping proto <-> `WeightReceiver`, token auth, and `serve`.

Every refusal, a rejected push or a missing token, becomes a gRPC status in one place (`_abort`, through
`STATUS`): the code, a detail that starts with the reason, and the `Reason` in the trailing metadata
(`vocabulary.REASON_KEY`). PushWeights decodes its requests with `codec.decode_chunk`, so tensor bytes reach
the receiver as views of the received buffers. Token, TLS and the bind rule come from one `ServerAccess`.

A push whose commit message names relay targets is forwarded by the server's `Relay` (`relay.py`) once it is
committed: the servicer holds the receiver (so its bytes stay as committed) from the moment it sees that
commit message until the relay is done, and GetStatus says `relaying` meanwhile. A server without a `Relay`
ignores the request (the learner then pushes to those targets itself).

Beside WeightSync, every server answers the standard `grpc.health.v1.Health` (for Kubernetes gRPC probes and
`grpc_health_probe`) and server reflection (for `grpcurl list`), both without a token: they reveal no
weights. Health per service: `asyncrlhf.v1.WeightSync` is SERVING while the server runs (it takes
pushes from the start); the overall status "" follows readiness: NOT_SERVING until the first version is
live, as the generator's /readyz.
"""

from __future__ import annotations

import hmac
import logging
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from typing import TYPE_CHECKING

import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection

from asyncrlhf._proto import weights_pb2 as pb
from asyncrlhf._proto import weights_pb2_grpc as pb_grpc
from asyncrlhf.service import is_loopback
from asyncrlhf.weights.access import AUTH_METADATA_KEY, GRPC_OPTIONS, SERVICE, ServerAccess
from asyncrlhf.weights.codec import decode_chunk
from asyncrlhf.weights.receiver import WeightReceiver
from asyncrlhf.weights.routes import registered
from asyncrlhf.weights.vocabulary import REASON_KEY, PushRejected, Reason

if TYPE_CHECKING:
    from asyncrlhf.weights.relay import Relay

log = logging.getLogger(__name__)
# Answered without a token: what probes and service browsers call.
OPEN_METHOD_PREFIXES = (f"/{health.SERVICE_NAME}/", f"/{reflection.SERVICE_NAME}/",
                        "/grpc.reflection.v1.ServerReflection/")
_SERVING, _NOT_SERVING = health_pb2.HealthCheckResponse.SERVING, health_pb2.HealthCheckResponse.NOT_SERVING

STATUS: dict[Reason, grpc.StatusCode] = {
    Reason.UNAUTHENTICATED: grpc.StatusCode.UNAUTHENTICATED,
    Reason.STALE_VERSION: grpc.StatusCode.FAILED_PRECONDITION,
    Reason.STALE_LINEAGE: grpc.StatusCode.FAILED_PRECONDITION,
    Reason.UNKNOWN_TENSOR: grpc.StatusCode.NOT_FOUND,
    Reason.SHAPE_MISMATCH: grpc.StatusCode.INVALID_ARGUMENT,
    Reason.DTYPE_MISMATCH: grpc.StatusCode.INVALID_ARGUMENT,
    Reason.BAD_OFFSET: grpc.StatusCode.INVALID_ARGUMENT,
    Reason.DUPLICATE_TENSOR: grpc.StatusCode.INVALID_ARGUMENT,
    Reason.TENSOR_COUNT: grpc.StatusCode.INVALID_ARGUMENT,
    Reason.MISSING_TENSORS: grpc.StatusCode.INVALID_ARGUMENT,
    Reason.BAD_CHECKSUM: grpc.StatusCode.DATA_LOSS,
    Reason.TRUNCATED: grpc.StatusCode.DATA_LOSS,
    Reason.SHM_UNAVAILABLE: grpc.StatusCode.FAILED_PRECONDITION,
    Reason.CHANNEL_UNAVAILABLE: grpc.StatusCode.FAILED_PRECONDITION,
    Reason.COLLECTIVE_UNAVAILABLE: grpc.StatusCode.FAILED_PRECONDITION,
    Reason.DELTA_BASE: grpc.StatusCode.FAILED_PRECONDITION,
}


def _abort(context: grpc.ServicerContext, refusal: PushRejected) -> None:
    """End the call (`abort` raises) with the status code of the refusal's reason, details that start with
    the reason, and the reason in the trailing metadata."""
    context.set_trailing_metadata(((REASON_KEY, refusal.reason.value),))
    context.abort(STATUS[refusal.reason], str(refusal))


class WeightSyncServicer(pb_grpc.WeightSyncServicer):
    """Maps the WeightSync RPCs onto a `WeightReceiver` (and its `Relay`, if any)."""

    def __init__(self, receiver: WeightReceiver, health_servicer: health.HealthServicer | None = None,
                 relay: Relay | None = None):
        self.receiver, self.health, self.relay = receiver, health_servicer, relay

    def PushWeights(self, request_iterator: Iterator[tuple[pb.WeightChunk, memoryview]],
                    context: grpc.ServicerContext) -> pb.PushReply:
        asked: list[pb.WeightChunk] = []  # the commit message, when it asks for a relay this server does
        try:
            result = self.receiver.receive(self._watch(request_iterator, asked))
        except PushRejected as err:
            self._unwatch(asked)
            _abort(context, err)
        except BaseException:  # e.g. the pusher cancelled the call mid-stream
            self._unwatch(asked)
            raise
        if asked and self.relay is not None:
            if result.relayable:
                self.relay.start(result, asked[0], self.receiver.release)
            else:
                log.warning("push of version %d asks this server to relay it; its engine's worker holds the "
                            "bytes (the learner pushes to them)", asked[0].version)
                self._unwatch(asked)
        if self.health is not None:
            self.health.set("", _SERVING)  # a version is live: ready
        version = result.snapshot.version
        return pb.PushReply(version=version.step, tensor_count=result.tensor_count,
                            bytes=result.bytes, apply_seconds=result.apply_seconds, lineage=version.lineage)

    def _watch(self, messages: Iterator[tuple[pb.WeightChunk, memoryview]],
               asked: list[pb.WeightChunk]) -> Iterator[tuple[pb.WeightChunk, memoryview]]:
        """`messages`, holding the receiver and announcing the relay as the commit asking for one goes by
        (before the new version shows in GetStatus)."""
        for header, data in messages:
            if header.commit and header.relay_targets and not asked:
                if self.relay is None:
                    log.warning("push of version %d asks this server to relay it to %d generators; it has "
                                "no relay (the learner pushes to them)", header.version,
                                len(header.relay_targets))
                else:
                    self.receiver.hold()
                    self.relay.expect()
                    asked.append(header)
            yield header, data

    def _unwatch(self, asked: list[pb.WeightChunk]) -> None:
        """The push asked for a relay but was not committed: nothing to relay."""
        if asked and self.relay is not None:
            self.receiver.release()
            self.relay.abandon()

    def GetStatus(self, request: pb.GetStatusRequest, context: grpc.ServicerContext) -> pb.GetStatusReply:
        status = self.receiver.status()
        reply = pb.GetStatusReply(version=status.version.step, updated_at=status.updated_at,
                                  tensor_count=status.tensor_count, lineage=status.version.lineage,
                                  relaying=self.relay is not None and self.relay.relaying)
        for spec in registered():  # what each route's sender reads to accept this generator
            spec.offer(self.receiver.ends.get(spec.route), reply)
        return reply


class TokenAuthInterceptor(grpc.ServerInterceptor):
    """Refuses every call whose `authorization` metadata is not `Bearer <token>` with UNAUTHENTICATED."""

    def __init__(self, token: str):
        self._expected = f"Bearer {token}".encode()

    def intercept_service(self, continuation, handler_call_details):
        if handler_call_details.method.startswith(OPEN_METHOD_PREFIXES):
            return continuation(handler_call_details)
        sent = dict(handler_call_details.invocation_metadata or ()).get(AUTH_METADATA_KEY, "")
        if hmac.compare_digest(str(sent).encode(), self._expected):
            return continuation(handler_call_details)
        handler = continuation(handler_call_details)
        refusal = PushRejected(Reason.UNAUTHENTICATED,
                               "missing or wrong token (set run.token or ASYNCRLHF_TOKEN on both sides)")

        def deny(_request, context):
            _abort(context, refusal)

        if handler is None:
            return None
        if handler.request_streaming and not handler.response_streaming:
            return grpc.stream_unary_rpc_method_handler(deny)
        if not handler.request_streaming and not handler.response_streaming:
            return grpc.unary_unary_rpc_method_handler(deny)
        return grpc.stream_stream_rpc_method_handler(deny) if handler.request_streaming else \
            grpc.unary_stream_rpc_method_handler(deny)


def serve(receiver: WeightReceiver, host: str = "127.0.0.1", port: int = 0,
          access: ServerAccess | None = None, *, relay: Relay | None = None, max_workers: int = 4,
          ) -> tuple[grpc.Server, int]:
    """Start a WeightSync server for `receiver` with `access` (token, TLS); returns the server and its port.
    With `relay` it forwards the versions whose pushes ask for it; the receiver's ends of its routes are
    offered in GetStatus (each route checks that its end may serve beside `access`: a data channel beside TLS
    only a TLS one, which it would otherwise bypass). The caller closes both."""
    access = access or ServerAccess()
    for spec in registered():
        spec.check_serving(receiver.ends.get(spec.route), access)
    if access.token is None and not access.allow_insecure_bind and not is_loopback(host):
        raise ValueError(f"refusing to serve WeightSync on {host} without a token: set run.token (or "
                         "ASYNCRLHF_TOKEN), bind 127.0.0.1, or set run.allow_insecure_bind=true")
    interceptors = [TokenAuthInterceptor(access.token)] if access.token else []
    server = grpc.server(ThreadPoolExecutor(max_workers=max_workers), interceptors=interceptors,
                         options=GRPC_OPTIONS)
    health_servicer = health.HealthServicer()
    health_servicer.set(SERVICE, _SERVING)
    health_servicer.set("", _SERVING if receiver.status().version.step else _NOT_SERVING)
    health_pb2_grpc.add_HealthServicer_to_server(health_servicer, server)
    reflection.enable_server_reflection((SERVICE, health.SERVICE_NAME, reflection.SERVICE_NAME), server)
    add_to_server(WeightSyncServicer(receiver, health_servicer, relay), server)
    address = f"{host}:{port}"  # with TLS credentials: TLS only, never also plaintext
    if access.credentials is not None:
        bound = server.add_secure_port(address, access.credentials)
    else:
        bound = server.add_insecure_port(address)
    if bound == 0:
        raise OSError(f"cannot bind WeightSync to {host}:{port}")
    server.start()
    return server, bound


def add_to_server(servicer: pb_grpc.WeightSyncServicer, server: grpc.Server) -> None:
    """Register `servicer` like the generated `add_WeightSyncServicer_to_server`, except that PushWeights
    decodes with `decode_chunk`, so its request iterator yields (header, data view) pairs: no copy of the
    tensor bytes through protobuf objects."""
    server.add_generic_rpc_handlers((grpc.method_handlers_generic_handler(SERVICE, {
        "PushWeights": grpc.stream_unary_rpc_method_handler(
            servicer.PushWeights, request_deserializer=decode_chunk,
            response_serializer=pb.PushReply.SerializeToString),
        "GetStatus": grpc.unary_unary_rpc_method_handler(
            servicer.GetStatus, request_deserializer=pb.GetStatusRequest.FromString,
            response_serializer=pb.GetStatusReply.SerializeToString),
    }),))

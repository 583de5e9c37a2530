"""The WeightSync gRPC surface: the servicer mapping proto <-> `WeightReceiver`, token auth, and `serve`.

Every refusal, a rejected push or a missing token, becomes a gRPC status in one place (`_abort`, through
`_STATUS`). PushWeights decodes its requests with `codec.decode_chunk`, so tensor bytes reach the receiver
as views of the received buffers. The method path, the auth metadata key and the channel options are
shared with the pusher.

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
from asyncrlhf.weights.channel import DataListener, Session
from asyncrlhf.weights.codec import MAX_MESSAGE_BYTES, decode_chunk
from asyncrlhf.weights.receiver import PushRejected, Reason, WeightReceiver
from asyncrlhf.weights.shm import shm_host

if TYPE_CHECKING:  # relay.py pushes, through pusher.py, which imports this module
    from asyncrlhf.weights.relay import Relay

log = logging.getLogger(__name__)
AUTH_METADATA_KEY = "authorization"
GRPC_OPTIONS = [
    ("grpc.max_receive_message_length", MAX_MESSAGE_BYTES + (1 << 20)),
    ("grpc.max_send_message_length", MAX_MESSAGE_BYTES + (1 << 20)),
]
SERVICE = pb.DESCRIPTOR.services_by_name["WeightSync"].full_name
# Answered without a token: what probes and service browsers call.
OPEN_METHOD_PREFIXES = (f"/{health.SERVICE_NAME}/", f"/{reflection.SERVICE_NAME}/",
                        "/grpc.reflection.v1.ServerReflection/")
_SERVING, _NOT_SERVING = health_pb2.HealthCheckResponse.SERVING, health_pb2.HealthCheckResponse.NOT_SERVING

_STATUS: dict[Reason, grpc.StatusCode] = {
    "unauthenticated": grpc.StatusCode.UNAUTHENTICATED,
    "stale_version": grpc.StatusCode.FAILED_PRECONDITION,
    "stale_lineage": grpc.StatusCode.FAILED_PRECONDITION,
    "unknown_tensor": grpc.StatusCode.NOT_FOUND,
    "shape_mismatch": grpc.StatusCode.INVALID_ARGUMENT,
    "dtype_mismatch": grpc.StatusCode.INVALID_ARGUMENT,
    "bad_offset": grpc.StatusCode.INVALID_ARGUMENT,
    "duplicate_tensor": grpc.StatusCode.INVALID_ARGUMENT,
    "tensor_count": grpc.StatusCode.INVALID_ARGUMENT,
    "missing_tensors": grpc.StatusCode.INVALID_ARGUMENT,
    "bad_checksum": grpc.StatusCode.DATA_LOSS,
    "truncated": grpc.StatusCode.DATA_LOSS,
    "shm_unavailable": grpc.StatusCode.FAILED_PRECONDITION,
    "channel_unavailable": grpc.StatusCode.FAILED_PRECONDITION,
}


def _abort(context: grpc.ServicerContext, refusal: PushRejected) -> None:
    """End the call (`abort` raises) with the status code of the refusal's reason; the details start with
    the reason."""
    context.abort(_STATUS[refusal.reason], str(refusal))


class WeightSyncServicer(pb_grpc.WeightSyncServicer):
    """Maps the WeightSync RPCs onto a `WeightReceiver` (and its `Relay`, if any)."""

    def __init__(self, receiver: WeightReceiver, health_servicer: health.HealthServicer | None = None,
                 relay: Relay | None = None, data: DataListener | None = None):
        self.receiver, self.health, self.relay, self.data = receiver, health_servicer, relay, data

    def PushWeights(self, request_iterator: Iterator[tuple[pb.WeightChunk, memoryview]],
                    context: grpc.ServicerContext) -> pb.PushReply:
        asked: list[pb.WeightChunk] = []  # the commit message, when it asks for a relay this server does
        try:
            with Session(self.data) as session:  # the push's data connection, if it names one
                result = self.receiver.receive(session.resolve(self._watch(request_iterator, asked)))
        except PushRejected as err:
            self._unwatch(asked)
            _abort(context, err)
        except BaseException:  # e.g. the pusher cancelled the call mid-stream
            self._unwatch(asked)
            raise
        if asked and self.relay is not None:
            self.relay.start(result, asked[0], self.receiver.release)
        if self.health is not None:
            self.health.set("", _SERVING)  # a version is live: ready
        return pb.PushReply(version=result.version, tensor_count=result.tensor_count, bytes=result.bytes,
                            apply_seconds=result.apply_seconds, lineage=result.lineage)

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
        return pb.GetStatusReply(version=status.version, updated_at=status.updated_at,
                                 tensor_count=status.tensor_count, lineage=status.lineage,
                                 shm_host=shm_host(), relaying=self.relay is not None and self.relay.relaying,
                                 data_port=self.data.port if self.data is not None else 0)


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
        refusal = PushRejected("unauthenticated",
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


def serve(
    receiver: WeightReceiver,
    host: str = "127.0.0.1",
    port: int = 0,
    token: str | None = None,
    *,
    allow_insecure_bind: bool = False,
    max_workers: int = 4,
    credentials: grpc.ServerCredentials | None = None,
    relay: Relay | None = None,
    data: DataListener | None = None,
) -> tuple[grpc.Server, int]:
    """Start a WeightSync server for `receiver` (TLS with `credentials`); returns the server and its port.
    With `relay` it forwards the versions whose pushes ask for it; with `data` it offers that data channel
    (`channel.py`; beside TLS `credentials` only a TLS one, which it would otherwise bypass). The caller
    closes both."""
    if data is not None and credentials is not None and data.tls is None:
        raise ValueError("a plaintext weight data channel beside TLS credentials would bypass them: give the "
                         "DataListener the server's ssl context (tls.server_ssl_context)")
    if token is None and not allow_insecure_bind and not is_loopback(host):
        raise ValueError(f"refusing to serve WeightSync on {host} without a token: set run.token (or "
                         "ASYNCRLHF_TOKEN), bind 127.0.0.1, or set run.allow_insecure_bind=true")
    interceptors = [TokenAuthInterceptor(token)] if token else []
    server = grpc.server(ThreadPoolExecutor(max_workers=max_workers), interceptors=interceptors,
                         options=GRPC_OPTIONS)
    health_servicer = health.HealthServicer()
    health_servicer.set(SERVICE, _SERVING)
    health_servicer.set("", _SERVING if receiver.status().version else _NOT_SERVING)
    health_pb2_grpc.add_HealthServicer_to_server(health_servicer, server)
    reflection.enable_server_reflection((SERVICE, health.SERVICE_NAME, reflection.SERVICE_NAME), server)
    add_to_server(WeightSyncServicer(receiver, health_servicer, relay, data), server)
    address = f"{host}:{port}"  # with `credentials` (asyncrlhf.weights.tls): TLS only, never also plaintext
    if credentials is not None:
        bound = server.add_secure_port(address, credentials)
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

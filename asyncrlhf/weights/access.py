"""How WeightSync ends reach each other, in one place: the method paths and channel options, the run's token
and TLS on both sides (gRPC and the data channel beside it), and the learner's channels to generators.

`ClientAccess` is what the learner's pusher and every generator's relay dial with; `ServerAccess` what a
generator serves with. Both are built from the config (`run.token`, `run.grpc_tls`, `run.allow_insecure_bind`)
by `from_config`, so the pusher, the relay and the server never wire TLS or auth themselves.
"""

from __future__ import annotations

import ssl
import threading
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass

import grpc

from asyncrlhf._proto import weights_pb2 as pb
from asyncrlhf._proto import weights_pb2_grpc as pb_grpc
from asyncrlhf.weights.codec import MAX_MESSAGE_BYTES
from asyncrlhf.weights.tls import (
    channel_credentials,
    channel_options,
    client_ssl_context,
    server_credentials,
    server_ssl_context,
)

AUTH_METADATA_KEY = "authorization"
GRPC_OPTIONS = [
    ("grpc.max_receive_message_length", MAX_MESSAGE_BYTES + (1 << 20)),
    ("grpc.max_send_message_length", MAX_MESSAGE_BYTES + (1 << 20)),
]
SERVICE = pb.DESCRIPTOR.services_by_name["WeightSync"].full_name
PUSH_METHOD = f"/{SERVICE}/PushWeights"
UNREACHABLE = {grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED}

# One PushWeights call: the serialized requests in, the receiver's reply out (grpc.RpcError if refused).
PushCall = Callable[[Iterator[bytes]], pb.PushReply]


@dataclass(frozen=True)
class ClientAccess:
    """How a pusher dials generators: `token` in the call metadata, TLS `credentials` (and channel options),
    and the data channel's TLS (`data_tls`, the name its certificate must carry: `server_name`, else the host
    dialed)."""

    token: str | None = None
    credentials: grpc.ChannelCredentials | None = None
    channel_options: Sequence[tuple[str, str]] = ()
    data_tls: ssl.SSLContext | None = None
    server_name: str | None = None

    @classmethod
    def from_config(cls, cfg) -> ClientAccess:
        """`run.token` and `run.grpc_tls`'s client settings."""
        tls = cfg.run.grpc_tls
        return cls(cfg.run.token, channel_credentials(tls), channel_options(tls), client_ssl_context(tls),
                   tls.server_name if tls else None)

    @property
    def metadata(self) -> tuple[tuple[str, str], ...]:
        return ((AUTH_METADATA_KEY, f"Bearer {self.token}"),) if self.token else ()

    @property
    def data_channel_allowed(self) -> bool:
        """Beside TLS gRPC only a TLS data channel: without its context, bytes stay on the TLS stream."""
        return self.credentials is None or self.data_tls is not None


@dataclass(frozen=True)
class ServerAccess:
    """How a generator serves WeightSync: the `token` every call must carry, TLS `credentials`, the data
    channel's TLS (`data_tls`), and whether a public bind without a token is allowed."""

    token: str | None = None
    credentials: grpc.ServerCredentials | None = None
    data_tls: ssl.SSLContext | None = None
    allow_insecure_bind: bool = False

    @classmethod
    def from_config(cls, cfg) -> ServerAccess:
        """`run.token`, `run.grpc_tls`'s server settings and `run.allow_insecure_bind`."""
        tls = cfg.run.grpc_tls
        return cls(cfg.run.token, server_credentials(tls), server_ssl_context(tls),
                   cfg.run.allow_insecure_bind)


class Channels:
    """gRPC channels to WeightSync servers, one per address, dialed with `access` and reused."""

    def __init__(self, access: ClientAccess):
        self.access = access
        self._channels: dict[str, grpc.Channel] = {}
        self._lock = threading.Lock()

    def get_status(self, address: str, timeout_s: float = 5.0) -> pb.GetStatusReply:
        stub = pb_grpc.WeightSyncStub(self._channel(address))
        return stub.GetStatus(pb.GetStatusRequest(), timeout=timeout_s, metadata=self.access.metadata)

    def push_call(self, address: str, timeout_s: float) -> PushCall:
        """PushWeights on `address`, its requests already serialized (no serializer), with the token."""
        call = self._channel(address).stream_unary(PUSH_METHOD, response_deserializer=pb.PushReply.FromString)

        def push(requests: Iterator[bytes]) -> pb.PushReply:
            return call(requests, timeout=timeout_s, metadata=self.access.metadata)

        return push

    def close(self) -> None:
        with self._lock:
            for channel in self._channels.values():
                channel.close()
            self._channels.clear()

    def _channel(self, address: str) -> grpc.Channel:
        with self._lock:
            if address not in self._channels:
                options = [*GRPC_OPTIONS, *self.access.channel_options]
                credentials = self.access.credentials
                self._channels[address] = (
                    grpc.secure_channel(address, credentials, options=options) if credentials
                    else grpc.insecure_channel(address, options=options))
            return self._channels[address]

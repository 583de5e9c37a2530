"""How WeightSync ends reach each other, in one place: the method paths and channel options, the run's token
and TLS on both sides (gRPC and the data channel beside it), and the learner's channels to generators.

TLS comes from `run.grpc_tls`: a server with `cert_file` + `key_file` serves TLS only; with `client_ca_file`
it also requires a client certificate signed by that CA (mutual TLS). A client with `ca_file` dials TLS and
verifies the server against it (and presents `client_cert_file` + `client_key_file` when set). The data
channel (`channel.py`) takes `ssl` contexts from the same files. Files are read once, at start; a missing or
half-configured pair fails at once with what to set.

`ClientAccess` is what the learner's pusher and every generator's relay dial with; `ServerAccess` what a
generator serves with. Both are built from the config (`run.token`, `run.grpc_tls`, `run.allow_insecure_bind`)
by `from_config`, so the pusher, the relay and the server never wire TLS or auth themselves.
"""

from __future__ import annotations

import ssl
import threading
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path

import grpc

from asyncrlhf._proto import weights_pb2 as pb
from asyncrlhf._proto import weights_pb2_grpc as pb_grpc
from asyncrlhf.weights.codec import MAX_MESSAGE_BYTES

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


class TlsConfigError(ValueError):
    """`run.grpc_tls` is incomplete or names a file that cannot be read."""


def _read(path: str, key: str) -> bytes:
    try:
        return Path(path).expanduser().read_bytes()
    except OSError as err:
        raise TlsConfigError(f"run.grpc_tls.{key}: cannot read {path}: {err.strerror}") from err


def _optional(path: str | None, key: str) -> bytes | None:
    return _read(path, key) if path is not None else None


def _pair(cert: str | None, key: str | None, names: tuple[str, str]) -> tuple[bytes, bytes] | None:
    if cert is None or key is None:
        if cert is not None or key is not None:
            missing = names[1] if key is None else names[0]
            raise TlsConfigError(f"run.grpc_tls: set both {names[0]} and {names[1]} (missing {missing})")
        return None
    return _read(key, names[1]), _read(cert, names[0])


def server_credentials(tls) -> grpc.ServerCredentials | None:
    """The WeightSync server's credentials, or None to serve without TLS (`tls`: a GrpcTlsConfig)."""
    if tls is None or not tls.serves_tls:
        if tls is not None and tls.client_ca_file:
            raise TlsConfigError("run.grpc_tls.client_ca_file needs cert_file and key_file (the server's)")
        return None
    pair = _pair(tls.cert_file, tls.key_file, ("cert_file", "key_file"))
    client_ca = _optional(tls.client_ca_file, "client_ca_file")
    return grpc.ssl_server_credentials([pair], root_certificates=client_ca,
                                       require_client_auth=client_ca is not None)


def channel_credentials(tls) -> grpc.ChannelCredentials | None:
    """The learner's credentials for dialing generators, or None to dial without TLS."""
    if tls is None or not tls.dials_tls:
        if tls is not None and (tls.client_cert_file or tls.client_key_file):
            raise TlsConfigError("run.grpc_tls.client_cert_file needs ca_file (to verify the server)")
        return None
    pair = _pair(tls.client_cert_file, tls.client_key_file, ("client_cert_file", "client_key_file"))
    key, cert = pair if pair else (None, None)
    return grpc.ssl_channel_credentials(root_certificates=_optional(tls.ca_file, "ca_file"), private_key=key,
                                        certificate_chain=cert)


def channel_options(tls) -> list[tuple[str, str]]:
    if tls is not None and tls.dials_tls and tls.server_name:
        return [("grpc.ssl_target_name_override", tls.server_name)]
    return []


def server_ssl_context(tls) -> ssl.SSLContext | None:
    """The data channel's TLS on a generator: the same certificate and client CA as its WeightSync server;
    None when that serves without TLS."""
    if server_credentials(tls) is None:  # also checks the files
        return None
    context = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    context.minimum_version = ssl.TLSVersion.TLSv1_2
    context.load_cert_chain(tls.cert_file, tls.key_file)
    if tls.client_ca_file:
        context.load_verify_locations(tls.client_ca_file)
        context.verify_mode = ssl.CERT_REQUIRED
    return context


def client_ssl_context(tls) -> ssl.SSLContext | None:
    """The data channel's TLS on the learner (and relays): verify the generator against `ca_file`, present the
    client certificate when set; None when WeightSync is dialed without TLS. The name checked is
    `server_name` when set, else the host dialed (`channel.Outgoing`)."""
    if channel_credentials(tls) is None:  # also checks the files
        return None
    context = ssl.create_default_context(cafile=tls.ca_file)
    context.minimum_version = ssl.TLSVersion.TLSv1_2
    if tls.client_cert_file:
        context.load_cert_chain(tls.client_cert_file, tls.client_key_file)
    return context


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

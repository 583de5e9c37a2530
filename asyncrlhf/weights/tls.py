"""TLS credentials for WeightSync from `run.grpc_tls`: the server's (generators) and the client's (learner),
for gRPC and, as `ssl` contexts from the same files, for the data channel beside it (`channel.py`).

A server with `cert_file` + `key_file` serves TLS only; with `client_ca_file` it also requires a client
certificate signed by that CA (mutual TLS). A client with `ca_file` dials TLS and verifies the server
against it (and presents `client_cert_file` + `client_key_file` when set). Files are read once, at start;
a missing or half-configured pair fails at once with what to set. `access.ClientAccess` and
`access.ServerAccess` are what the pusher, the relay and the server take: built from these, in one place.
"""

from __future__ import annotations

import ssl
from pathlib import Path

import grpc


class TlsConfigError(ValueError):
    """`run.grpc_tls` is incomplete or names a file that cannot be read."""


def _read(path: str | None, key: str) -> bytes | None:
    if path is None:
        return None
    try:
        return Path(path).expanduser().read_bytes()
    except OSError as err:
        raise TlsConfigError(f"run.grpc_tls.{key}: cannot read {path}: {err.strerror}") from err


def _pair(cert: str | None, key: str | None, names: tuple[str, str]) -> tuple[bytes, bytes] | None:
    if (cert is None) != (key is None):
        missing = names[1] if key is None else names[0]
        raise TlsConfigError(f"run.grpc_tls: set both {names[0]} and {names[1]} (missing {missing})")
    if cert is None:
        return None
    return _read(key, names[1]), _read(cert, names[0])  # type: ignore[return-value]


def server_credentials(tls) -> grpc.ServerCredentials | None:
    """The WeightSync server's credentials, or None to serve without TLS (`tls`: a GrpcTlsConfig)."""
    if tls is None or not tls.serves_tls:
        if tls is not None and tls.client_ca_file:
            raise TlsConfigError("run.grpc_tls.client_ca_file needs cert_file and key_file (the server's)")
        return None
    pair = _pair(tls.cert_file, tls.key_file, ("cert_file", "key_file"))
    client_ca = _read(tls.client_ca_file, "client_ca_file")
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
    return grpc.ssl_channel_credentials(root_certificates=_read(tls.ca_file, "ca_file"), private_key=key,
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

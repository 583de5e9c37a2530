"""The data channel route (`Route.DATA`): a push's tensor bytes over a TCP connection beside its gRPC call.

gRPC carries control (every tensor's name, shape and dtype, the version, the commit) and the TCP connection
carries the bytes, sent from the tensors' own memory and received into the receiver's staging buffers, each
hashed block by block while it is in cache: no user-space copy on either side, where a gRPC byte stream
copies each chunk into a message, into HTTP/2 frames and back out (`docs/weights.md`, "The data channel").
This module holds what both ends share and the learner end (`DataSender`); `channel_read.py` the generator
end (`DataSource`, and `DataListener`, the generator's standing end), where the route is registered.

- **Opening**: the pusher draws a one-time ticket (`TICKET_BYTES` random bytes), connects to the receiver's
  data port (its GetStatus says which) and sends the ticket first; the same ticket rides on every tensor
  message of the push's gRPC call, which carries the run's token. The receiver pairs the two by the ticket
  (`channel_read.DataListener.claim`): a connection that sends no ticket within `CLAIM_TIMEOUT_S`, or that
  no push claims within `PARKED_S`, is closed, and a connection carries exactly one push.
- **Bytes**: each tensor's bytes in the order of its messages, then its XXH3-64 (8 bytes, little-endian),
  computed by the sender while sending (or the checksum a relay verified, passed on): `send_tensors`,
  `receive_into`. What the receiver verifies is what it stored, as on the byte stream.
- **Failure**: an early end of the connection or a silent sender (`channel_read.IDLE_TIMEOUT_S`) is
  `truncated`, a wrong hash `bad_checksum`, a ticket whose connection never comes `channel_unavailable`
  (the pusher then streams over gRPC): every one a refused push, the old version still serving.

Beside a TLS WeightSync the channel is TLS too, from the same files (`access.server_ssl_context`,
`access.client_ssl_context`: the generator's certificate, the client CA for mutual TLS): a TLS server refuses
a plaintext channel, and a TLS pusher uses a data channel only with its `ssl` context.
"""

from __future__ import annotations

import contextlib
import itertools
import logging
import secrets
import socket
import ssl
import threading
from collections.abc import Iterator, Sequence

import xxhash

from asyncrlhf._proto import weights_pb2 as pb
from asyncrlhf.weights.access import ClientAccess, PushCall
from asyncrlhf.weights.codec import Snapshot, WireTensor, tensor_header
from asyncrlhf.weights.routes import SenderSettings
from asyncrlhf.weights.vocabulary import Route

log = logging.getLogger(__name__)

TICKET_BYTES = 16
CHECKSUM_BYTES = 8
BLOCK = 1 << 20  # sent or received, then hashed while in cache (the size: docs/weights.md)
CLAIM_TIMEOUT_S = 10.0  # a ticket's connection, or a connection's ticket, must come within this


def new_ticket() -> bytes:
    return secrets.token_bytes(TICKET_BYTES)


def split_address(address: str) -> str:
    """The host of a `host:port` gRPC address (`[v6]:port` too)."""
    host = address.rsplit(":", 1)[0]
    return host[1:-1] if host.startswith("[") and host.endswith("]") else host


class Connection:
    """One push's data connection, either end: `abort` wakes a read or send blocked on it (it fails at
    once), `close` also releases it."""

    def __init__(self, sock: socket.socket):
        self.sock = sock

    def abort(self) -> None:
        with contextlib.suppress(OSError):
            self.sock.shutdown(socket.SHUT_RDWR)

    def close(self) -> None:
        self.abort()
        self.sock.close()


class Outgoing(Connection):
    """The sending end: opened with the ticket sent, then `send` streams the tensors' bytes and checksums
    (on its own thread while gRPC sends the control messages); aborted when the gRPC call ends first."""

    def __init__(self, host: str, port: int, ticket: bytes, timeout_s: float,
                 tls: ssl.SSLContext | None = None, server_name: str | None = None):
        """`tls`: a client-side context (the receiver's certificate must name `server_name`, else `host`)."""
        super().__init__(socket.create_connection((host, port), timeout=min(timeout_s, CLAIM_TIMEOUT_S)))
        try:
            if tls is not None:
                self.sock = tls.wrap_socket(self.sock, server_hostname=server_name or host)
            self.sock.settimeout(timeout_s)
            self.sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            self.sock.sendall(ticket)
        except OSError:
            self.sock.close()
            raise

    def send(self, tensors: Sequence[WireTensor]) -> None:
        """Every tensor's bytes from its own memory, each followed by its checksum: the one it carries (a
        relay passing on what it verified) or XXH3-64 computed block by block as the block is sent."""
        for t in tensors:
            digest = xxhash.xxh3_64()
            for start in range(0, t.data.nbytes, BLOCK):
                block = t.data[start:start + BLOCK]
                if t.checksum is None:
                    digest.update(block)
                self.sock.sendall(block)
            checksum = digest.intdigest() if t.checksum is None else t.checksum
            self.sock.sendall(checksum.to_bytes(CHECKSUM_BYTES, "little"))


def control_messages(push: Snapshot, ticket: bytes) -> Iterator[bytes]:
    """The gRPC side of a data-channel push, without its commit: one control message per tensor."""
    for t in push.tensors:
        yield tensor_header(push.version, t, data_ticket=ticket).SerializeToString()


class DataTransfer:
    """One version over the data channels of a round's targets: each push opens its own connection."""

    def __init__(self, push: Snapshot, sender: DataSender):
        self.push, self.sender = push, sender

    def send_weights(self, call: PushCall, address: str, commit: bytes) -> pb.PushReply:
        """Open the connection to the target's data port (OSError if it cannot be), send the tensors' bytes
        over it on a thread of their own while `call` sends the control messages and then `commit`. If `call`
        raises, the sending stops at once (the receiver has stopped reading) and the error is the caller's."""
        ticket, access = new_ticket(), self.sender.access
        outgoing = Outgoing(split_address(address), self.sender.port(address), ticket, self.sender.timeout_s,
                            access.data_tls, access.server_name)

        def send() -> None:
            with contextlib.suppress(OSError):  # the receiver closed the connection: its gRPC status says why
                outgoing.send(self.push.tensors)

        sending = threading.Thread(target=send, name="weight-data-send", daemon=True)
        sending.start()
        try:
            return call(itertools.chain(control_messages(self.push, ticket), (commit,)))
        except BaseException:
            outgoing.abort()
            raise
        finally:
            sending.join()
            outgoing.close()

    def close(self) -> None:
        """Each push's connection is closed with it."""


class DataSender:
    """The learner end of `Route.DATA`: generators whose GetStatus offers a data port, when `access` allows a
    data channel (beside TLS gRPC, a TLS one only)."""

    route = Route.DATA

    def __init__(self, access: ClientAccess, timeout_s: float):
        self.access, self.timeout_s = access, timeout_s
        self._ports: dict[str, int] = {}  # address -> its data channel's port

    def accepts(self, address: str, status: pb.GetStatusReply) -> bool:
        if status.data_port and self.access.data_channel_allowed:
            self._ports[address] = status.data_port
            return True
        return False

    def port(self, address: str) -> int:
        return self._ports[address]

    def forget(self, address: str) -> None:
        self._ports.pop(address, None)

    def begin(self, push: Snapshot, targets: int) -> DataTransfer:
        return DataTransfer(push, self)

    def close(self) -> None:
        """Connections live as long as their push."""


def sender(settings: SenderSettings) -> DataSender | None:
    return DataSender(settings.access, settings.timeout_s) if settings.access.data_channel_allowed else None

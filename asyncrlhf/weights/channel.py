"""The data channel route (`Route.DATA`): a push's tensor bytes over a TCP connection beside its gRPC call.

gRPC carries control (every tensor's name, shape and dtype, the version, the commit) and the TCP connection
carries the bytes, sent from the tensors' own memory and received into the receiver's staging buffers, each
hashed block by block while it is in cache: no user-space copy on either side, where a gRPC byte stream
copies each chunk into a message, into HTTP/2 frames and back out (`docs/weights.md`, "The data channel").
`DataSender` is its learner end, `DataSource` its generator end, `DataListener` the generator's standing
end (the route is registered below).

- **Opening**: the pusher draws a one-time ticket (`TICKET_BYTES` random bytes), connects to the receiver's
  data port (its GetStatus says which) and sends the ticket first; the same ticket rides on every tensor
  message of the push's gRPC call, which carries the run's token. The receiver pairs the two by the ticket
  (`DataListener.claim`): a connection that sends no ticket within `CLAIM_TIMEOUT_S`, or that no push
  claims within `PARKED_S`, is closed, and a connection carries exactly one push.
- **Bytes**: each tensor's bytes in the order of its messages, then its XXH3-64 (8 bytes, little-endian),
  computed by the sender while sending (or the checksum a relay verified, passed on): `send_tensors`,
  `receive_into`. What the receiver verifies is what it stored, as on the byte stream.
- **Failure**: an early end of the connection or a silent sender (`IDLE_TIMEOUT_S`) is `truncated`, a wrong
  hash `bad_checksum`, a ticket whose connection never comes `channel_unavailable` (the pusher then streams
  over gRPC): every one a refused push, the old version still serving.

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
import time
from collections.abc import Iterator, Sequence

import numpy as np
import xxhash

from asyncrlhf._proto import weights_pb2 as pb
from asyncrlhf.weights.access import ClientAccess, PushCall, ServerAccess
from asyncrlhf.weights.codec import Snapshot, WireTensor, nbytes_of, tensor_header
from asyncrlhf.weights.routes import Fallback, RouteSpec, SenderSettings, register
from asyncrlhf.weights.vocabulary import PushRejected, Reason, Route

log = logging.getLogger(__name__)

TICKET_BYTES = 16
CHECKSUM_BYTES = 8
BLOCK = 1 << 20  # sent or received, then hashed while in cache (the size: docs/weights.md)
CLAIM_TIMEOUT_S = 10.0  # a ticket's connection, or a connection's ticket, must come within this
PARKED_S = 120.0  # a connection with its ticket waits this long for its push (behind one in progress)
IDLE_TIMEOUT_S = 30.0  # a receiver gives up on a connection silent this long mid-push
MAX_PENDING = 32  # connections accepted and not yet claimed; more are closed at once


def new_ticket() -> bytes:
    return secrets.token_bytes(TICKET_BYTES)


def split_address(address: str) -> str:
    """The host of a `host:port` gRPC address (`[v6]:port` too)."""
    host = address.rsplit(":", 1)[0]
    return host[1:-1] if host.startswith("[") and host.endswith("]") else host


def _read_exactly(sock: socket.socket, view: memoryview) -> None:
    got = 0
    while got < len(view):
        n = sock.recv_into(view[got:])
        if not n:
            raise EOFError(f"the connection ended after {got} of {len(view)} bytes")
        got += n


class DataListener:
    """The receiving end: accepts data connections on `host:port` (0: a free port; `port` says which) and
    holds each, by its ticket, until the push that names the ticket claims it."""

    def __init__(self, host: str = "127.0.0.1", port: int = 0, claim_timeout_s: float = CLAIM_TIMEOUT_S,
                 tls: ssl.SSLContext | None = None):
        """`tls`: serve the channel over TLS (a server-side context), as WeightSync beside it."""
        self.claim_timeout_s, self.tls = claim_timeout_s, tls
        family = socket.AF_INET6 if ":" in host else socket.AF_INET
        self._sock = socket.socket(family, socket.SOCK_STREAM)
        self._sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            self._sock.bind((host, port))
        except OSError as err:
            self._sock.close()
            raise OSError(f"cannot bind the weight data channel to {host}:{port}: {err.strerror} "
                          "(set generator.data_port to a free port, or 0)") from err
        self._sock.listen(16)
        self.port: int = self._sock.getsockname()[1]
        self._waiting: dict[bytes, tuple[socket.socket, float]] = {}
        self._handshakes = 0
        self._cond = threading.Condition()
        self._closed = False
        self._acceptor = threading.Thread(target=self._accept, name="weight-data-accept", daemon=True)
        self._acceptor.start()

    def _accept(self) -> None:
        while True:
            try:
                conn, _ = self._sock.accept()
            except OSError:  # closed
                return
            with self._cond:
                self._sweep()
                busy = self._closed or self._handshakes + len(self._waiting) >= MAX_PENDING
                if not busy:
                    self._handshakes += 1
            if busy:
                conn.close()
                continue
            threading.Thread(target=self._handshake, args=(conn,), name="weight-data-ticket",
                             daemon=True).start()

    def _handshake(self, conn: socket.socket) -> None:
        """Read the connection's ticket and park it; a connection that sends none in time is closed."""
        ticket = bytearray(TICKET_BYTES)
        try:
            conn.settimeout(self.claim_timeout_s)
            if self.tls is not None:  # a client that fails the handshake (no certificate...) is closed
                conn = self.tls.wrap_socket(conn, server_side=True)
            _read_exactly(conn, memoryview(ticket))
            conn.settimeout(IDLE_TIMEOUT_S)
        except (OSError, EOFError):
            conn.close()
            ticket = bytearray()
        with self._cond:
            self._handshakes -= 1
            if ticket and not self._closed and bytes(ticket) not in self._waiting:
                self._waiting[bytes(ticket)] = (conn, time.monotonic())
                self._cond.notify_all()
            elif ticket:
                conn.close()

    def _sweep(self) -> None:
        """Close connections nobody claimed in time (under the lock)."""
        now = time.monotonic()
        for ticket, (conn, since) in list(self._waiting.items()):
            if now - since > max(PARKED_S, self.claim_timeout_s):
                del self._waiting[ticket]
                conn.close()

    def claim(self, ticket: bytes) -> socket.socket:
        """The connection that sent `ticket`, once it has; `channel_unavailable` if none does in time."""
        with self._cond:
            found = self._cond.wait_for(lambda: ticket in self._waiting or self._closed, self.claim_timeout_s)
            if not found or self._closed:
                raise PushRejected(Reason.CHANNEL_UNAVAILABLE,
                                   f"no data connection presented this push's ticket within "
                                   f"{self.claim_timeout_s:g} s (is the data port {self.port} reachable from "
                                   "the pusher?); push over the gRPC stream")
            conn, _ = self._waiting.pop(ticket)
            return conn

    def close(self) -> None:
        with self._cond:
            self._closed = True
            waiting, self._waiting = self._waiting, {}
            self._cond.notify_all()
        with contextlib.suppress(OSError):
            self._sock.shutdown(socket.SHUT_RDWR)
        self._sock.close()
        for conn, _ in waiting.values():
            conn.close()
        self._acceptor.join(5)


class _Connection:
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


class Incoming(_Connection):
    """The receiving end: `receive_into` reads the next tensor's bytes into a buffer. Claimed by
    `DataSource`; closed when the push ends, aborted when the receiver refuses it (the read in progress
    fails as truncated and the sender's further bytes are refused)."""

    def receive_into(self, view: memoryview, digest: xxhash.xxh3_64, name: str) -> int:
        """Fill `view` from the connection, hashing each block as it lands; return the sender's checksum."""
        try:
            for start in range(0, len(view), BLOCK):
                block = view[start:start + BLOCK]
                _read_exactly(self.sock, block)
                digest.update(block)
            trailer = bytearray(CHECKSUM_BYTES)
            _read_exactly(self.sock, memoryview(trailer))
        except TimeoutError as err:
            raise PushRejected(Reason.TRUNCATED, f"`{name}`: the data connection was silent for "
                                                 f"{IDLE_TIMEOUT_S:g} s mid-tensor") from err
        except (OSError, EOFError) as err:
            raise PushRejected(Reason.TRUNCATED,
                               f"`{name}`: the data connection broke mid-tensor: {err}") from err
        return int.from_bytes(trailer, "little")


class IncomingTensor:
    """One tensor's bytes on the push's data connection (a `Payload`): read straight into the buffer,
    hashed as they land, followed by the sender's checksum."""

    def __init__(self, incoming: Incoming, header: pb.WeightChunk):
        self.incoming, self.name, self.nbytes = incoming, header.name, nbytes_of(header)

    def copy_into(self, dst: np.ndarray, digest: xxhash.xxh3_64) -> int:
        written = memoryview(dst)  # type: ignore[arg-type]  # numpy's stub: an ndarray is a buffer
        return self.incoming.receive_into(written, digest, self.name)

    def abort(self) -> None:
        self.incoming.abort()


class DataSource:
    """The generator end of `Route.DATA` for one push: it claims the tensor messages that carry a ticket and
    pairs them with the `Incoming` connection of that ticket (claimed on the first). Use as a context manager:
    the connection is closed when the push ends, whatever the outcome."""

    route = Route.DATA

    def __init__(self, listener: DataListener | None):
        self.listener = listener
        self.incoming: Incoming | None = None
        self._ticket = b""

    def payload(self, header: pb.WeightChunk, inline: memoryview) -> IncomingTensor:
        return IncomingTensor(self._incoming(header.data_ticket), header)

    def _incoming(self, ticket: bytes) -> Incoming:
        if self.listener is None:
            raise PushRejected(Reason.CHANNEL_UNAVAILABLE, "this receiver has no data channel (its GetStatus "
                                                           "says data_port 0); push over the gRPC stream")
        if self.incoming is None:
            self.incoming, self._ticket = Incoming(self.listener.claim(ticket)), ticket
        elif ticket != self._ticket:
            raise PushRejected(Reason.CHANNEL_UNAVAILABLE, "a push names one data connection; this message "
                                                           "names another ticket")
        return self.incoming

    def __enter__(self) -> DataSource:
        return self

    def __exit__(self, *exc: object) -> None:
        if self.incoming is not None:
            self.incoming.close()


class Outgoing(_Connection):
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


def _sender(settings: SenderSettings) -> DataSender | None:
    return DataSender(settings.access, settings.timeout_s) if settings.access.data_channel_allowed else None


def _offer(listener: DataListener | None, status: pb.GetStatusReply) -> None:
    status.data_port = listener.port if listener is not None else 0


def _check_serving(listener: DataListener | None, access: ServerAccess) -> None:
    if listener is not None and access.credentials is not None and listener.tls is None:
        raise ValueError("a plaintext weight data channel beside TLS credentials would bypass them: give the "
                         "DataListener the server's ssl context (ServerAccess.data_tls)")


# A ticket whose connection never came is the receiver's view: keep off the channel for that generator. A
# connection the pusher cannot make may heal (a restart): ask again at the next push.
register(RouteSpec(Route.DATA, _sender, lambda header: bool(header.data_ticket), DataSource, preference=30,
                   offer=_offer, check_serving=_check_serving,
                   fallbacks={Reason.CHANNEL_UNAVAILABLE: Fallback(avoid=True),
                              OSError: Fallback(avoid=False)}))

"""The generator end of the data channel route (`Route.DATA`, `channel.py`), registered here: `DataListener`
accepts the pushers' connections on the generator's data port and holds each by its ticket, `DataSource` pairs
one push's tensor messages with its connection, and `Incoming` reads each tensor's bytes straight into the
staging buffer, hashed as they land."""

from __future__ import annotations

import contextlib
import socket
import ssl
import threading
import time

import numpy as np
import xxhash

from asyncrlhf._proto import weights_pb2 as pb
from asyncrlhf.weights.access import ServerAccess
from asyncrlhf.weights.channel import (
    BLOCK,
    CHECKSUM_BYTES,
    CLAIM_TIMEOUT_S,
    TICKET_BYTES,
    Connection,
    sender,
)
from asyncrlhf.weights.codec import nbytes_of
from asyncrlhf.weights.routes import Fallback, RouteSpec, register
from asyncrlhf.weights.vocabulary import PushRejected, Reason, Route

PARKED_S = 120.0  # a connection with its ticket waits this long for its push (behind one in progress)
IDLE_TIMEOUT_S = 30.0  # a receiver gives up on a connection silent this long mid-push
MAX_PENDING = 32  # connections accepted and not yet claimed; more are closed at once


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


class Incoming(Connection):
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


def _offer(listener: DataListener | None, status: pb.GetStatusReply) -> None:
    status.data_port = listener.port if listener is not None else 0


def _check_serving(listener: DataListener | None, access: ServerAccess) -> None:
    if listener is not None and access.credentials is not None and listener.tls is None:
        raise ValueError("a plaintext weight data channel beside TLS credentials would bypass them: give the "
                         "DataListener the server's ssl context (ServerAccess.data_tls)")


# A ticket whose connection never came is the receiver's view: keep off the channel for that generator. A
# connection the pusher cannot make may heal (a restart): ask again at the next push.
register(RouteSpec(Route.DATA, sender, lambda header: bool(header.data_ticket), DataSource, preference=30,
                   offer=_offer, check_serving=_check_serving,
                   fallbacks={Reason.CHANNEL_UNAVAILABLE: Fallback(avoid=True),
                              OSError: Fallback(avoid=False)}))

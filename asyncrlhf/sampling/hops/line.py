"""A control connection between two processes of one host with a deadline on every read and write: length-
prefixed messages over an AF_UNIX stream socket, authenticated both ways with a shared key (each end sends
a random challenge and checks the other's HMAC-SHA256 of it).

`multiprocessing.connection`'s own `Listener` and `Client` wait without a deadline: a peer that connects and
then stalls (stopped, wedged, a stranger that never answers the challenge) holds the listener's `accept` or a
caller's `recv` for ever. Here a stalled peer costs one `TimeoutError` (an `OSError`) after `timeout_s`; the
listener hands each connection, challenge included, to its own thread, so none waits on another. The one
wait without a deadline is for the first byte of the next request on a connection kept open between
requests (`recv_bytes(idle=True)`): a quiet client is not a stalled one.
"""

from __future__ import annotations

import hashlib
import hmac
import secrets
import socket
import struct
import time
from multiprocessing import AuthenticationError

LINE_S = 10.0  # a message, once begun, and the key challenge: each within this long
_HEADER = struct.Struct("!I")
MAX_MESSAGE = 64 << 20


class Line:
    """One connected end (see the module); closes its socket on exit."""

    def __init__(self, sock: socket.socket, timeout_s: float = LINE_S):
        self.sock, self.timeout_s = sock, timeout_s

    @classmethod
    def connect(cls, address: str, authkey: bytes, timeout_s: float = LINE_S) -> Line:
        """Dial `address` and prove the key both ways (raises OSError, EOFError or AuthenticationError)."""
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        line = cls(sock, timeout_s)
        try:
            sock.settimeout(timeout_s)
            sock.connect(address)
            line._prove(authkey)
        except BaseException:
            line.close()
            raise
        return line

    def accepted(self, authkey: bytes) -> Line:
        """The listener's end of a new connection, once the client proved the key."""
        self._prove(authkey)
        return self

    def _prove(self, authkey: bytes) -> None:
        """Both ends at once: send a challenge, answer the peer's, check the peer's answer to ours (raises
        AuthenticationError)."""
        ours = secrets.token_bytes(32)
        self.send_bytes(ours)
        self.send_bytes(hmac.new(authkey, self.recv_bytes(64), hashlib.sha256).digest())
        if not hmac.compare_digest(self.recv_bytes(64), hmac.new(authkey, ours, hashlib.sha256).digest()):
            raise AuthenticationError("the peer does not hold the key")

    def send_bytes(self, data: bytes) -> None:
        self.sock.settimeout(self.timeout_s)  # sendall's timeout bounds the whole message
        self.sock.sendall(_HEADER.pack(len(data)) + data)

    def recv_bytes(self, maxlength: int | None = None, *, timeout_s: float | None = None,
                   idle: bool = False) -> bytes:
        """The next message, whole within `timeout_s` (default the line's) of its first byte, or of now unless
        `idle` (then the first byte may take as long as it takes). EOFError: the peer closed."""
        wait = self.timeout_s if timeout_s is None else timeout_s
        first = self._exactly(1, None if idle else time.monotonic() + wait)
        deadline = time.monotonic() + wait
        (n,) = _HEADER.unpack(first + self._exactly(_HEADER.size - 1, deadline))
        if n > (maxlength or MAX_MESSAGE):
            raise OSError(f"a message of {n} bytes is larger than this line takes")
        return self._exactly(n, deadline)

    def _exactly(self, n: int, deadline: float | None) -> bytes:
        out = bytearray()
        while len(out) < n:
            left = None if deadline is None else deadline - time.monotonic()
            try:
                if left is not None and left <= 0:
                    raise TimeoutError
                self.sock.settimeout(left)
                chunk = self.sock.recv(n - len(out))
            except TimeoutError:
                raise TimeoutError(f"the peer sent only {len(out)} of {n} bytes in time") from None
            if not chunk:
                raise EOFError("the peer closed the connection")
            out += chunk
        return bytes(out)

    def close(self) -> None:
        self.sock.close()

    def __enter__(self) -> Line:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def listener(address: str) -> socket.socket:
    """A listening AF_UNIX socket at `address` (an abstract one when it starts with NUL: no file)."""
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    sock.bind(address)
    sock.listen()
    return sock

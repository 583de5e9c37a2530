"""A TCP link to a real server that can hang or die: what a client of that server sees when the server
stalls on a request (a connection accepted and never answered) or its process is killed (every open
connection reset, new ones refused) and comes back on the same address."""

from __future__ import annotations

import socket
import struct
import threading


class FaultyLink:
    """Forwards 127.0.0.1:`port` to `upstream`; `stall(n)` holds the next n connections unanswered, `kill()`
    resets every connection and refuses new ones, `revive()` listens again on the same port."""

    def __init__(self, upstream: tuple[str, int]):
        self.upstream = upstream
        self._stall = 0
        self.stalled = 0  # connections held so far
        self._sockets: list[socket.socket] = []
        self._lock = threading.Lock()
        self._listener = socket.create_server(("127.0.0.1", 0))
        self.port = self._listener.getsockname()[1]
        self._serve(self._listener)

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def stall(self, connections: int) -> None:
        with self._lock:
            self._stall = connections

    def kill(self) -> None:
        """As a killed server: the listener closes, every connection is reset (RST, not a clean close)."""
        try:
            self._listener.shutdown(socket.SHUT_RDWR)  # wakes the accepting thread (close alone does not)
        except OSError:
            pass
        self._listener.close()
        with self._lock:
            sockets, self._sockets = self._sockets, []
        for sock in sockets:
            try:
                sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
                sock.close()
            except OSError:
                pass

    def revive(self) -> None:
        self._listener = socket.create_server(("127.0.0.1", self.port))
        self._serve(self._listener)

    def close(self) -> None:
        self.kill()

    def _serve(self, listener: socket.socket) -> None:
        threading.Thread(target=self._accept, args=(listener,), daemon=True).start()

    def _accept(self, listener: socket.socket) -> None:
        while True:
            try:
                client, _ = listener.accept()
            except OSError:  # closed by kill()
                return
            with self._lock:
                self._sockets.append(client)
                hold = self._stall > 0
                self._stall -= hold
                self.stalled += hold
            if not hold:
                server = socket.create_connection(self.upstream)
                with self._lock:
                    self._sockets.append(server)
                for src, dst in ((client, server), (server, client)):
                    threading.Thread(target=_pump, args=(src, dst), daemon=True).start()


def _pump(src: socket.socket, dst: socket.socket) -> None:
    try:
        while data := src.recv(65536):
            dst.sendall(data)
    except OSError:
        pass
    finally:
        try:
            dst.shutdown(socket.SHUT_WR)
        except OSError:
            pass

"""How a push reaches each generator, asked once per address: its shared memory, its data channel, or the
gRPC byte stream (`Routes.path`), and what a failed route falls back to."""

from __future__ import annotations

from collections.abc import Callable

import grpc

from asyncrlhf._proto import weights_pb2 as pb

UNREACHABLE = {grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED}


class Routes:
    """`get_status(address)` is the receiver's GetStatus; `shm_host` this host's shared memory ("": none);
    `data_channel`: use the data channels receivers offer."""

    def __init__(self, get_status: Callable[[str], pb.GetStatusReply], shm_host: str, data_channel: bool):
        self._get_status, self.shm_host, self.data_channel = get_status, shm_host, data_channel
        self._local: dict[str, bool] = {}  # address -> shares this host's shared memory
        self._data_ports: dict[str, int] = {}  # address -> its data channel's port (0: none)

    def path(self, address: str) -> str:
        """"shm" (it shares this host's shared memory), "data" (it offers a data channel), "stream", or
        "unreachable:<code>" (no answer to GetStatus: the push would get none)."""
        if not self.shm_host and not self.data_channel:
            return "stream"
        if address not in self._local:
            try:
                status = self._get_status(address)
            except grpc.RpcError as err:
                return f"unreachable:{err.code().name}" if err.code() in UNREACHABLE else "stream"
            self._data_ports[address] = status.data_port if self.data_channel else 0
            self._local[address] = bool(self.shm_host) and status.shm_host == self.shm_host
        if self._local[address]:
            return "shm"
        return "data" if self._data_ports.get(address) else "stream"

    def data_port(self, address: str) -> int:
        return self._data_ports.get(address, 0)

    def local_receivers(self) -> int:
        return sum(self._local.values())

    def no_shm(self, address: str) -> None:
        """It does not see our segments: stream to it from now on."""
        self._local[address] = False

    def no_data(self, address: str) -> None:
        """It cannot pair our data connections: stream to it from now on."""
        self._data_ports[address] = 0

    def forget(self, address: str) -> None:
        """Ask it again at the next push (its data channel could not be reached: did a restart move it?)."""
        self._local.pop(address, None)
        self._data_ports.pop(address, None)

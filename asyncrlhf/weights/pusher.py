"""The pushing side (learner): one version to many WeightSync servers at once.

`WeightPusher.push(state_dict, version, targets)` casts floating tensors to the push dtype once, checksums
each tensor once (XXH3-64, in a background thread, shared by all targets) and streams chunks to every
target concurrently, each with its own deadline, encoding the next chunk while gRPC sends this one; it
returns one `PushOutcome` per target: ok, rejected (the receiver's reason) or unreachable.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator, Mapping, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from queue import Full, Queue
from typing import Literal

import grpc
import torch

from asyncrlhf._proto import weights_pb2 as pb
from asyncrlhf._proto import weights_pb2_grpc as pb_grpc
from asyncrlhf.weights.codec import MAX_MESSAGE_BYTES, WireTensor, checksum, encoded_chunks, prepare
from asyncrlhf.weights.server import AUTH_METADATA_KEY, GRPC_OPTIONS, SERVICE

PushStatus = Literal["ok", "rejected", "unreachable"]

@dataclass(frozen=True)
class PushTarget:
    id: str
    address: str  # host:port of the generator's WeightSync server


@dataclass(frozen=True)
class PushOutcome:
    """What happened to one target: `ok`, `rejected` (the receiver refused; `detail` says why) or
    `unreachable` (no answer within the deadline)."""

    target: PushTarget
    status: PushStatus
    code: str  # gRPC status code name ("OK", "DATA_LOSS", "UNAVAILABLE", ...)
    detail: str
    version: int  # the version the target now serves, when ok
    seconds: float
    bytes: int


_UNREACHABLE = {grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED}


def prefetched(items: Iterator[bytes], depth: int = 2) -> Iterator[bytes]:
    """`items`, produced up to `depth` ahead by a background thread, so that encoding the next chunk overlaps
    gRPC sending this one. Closing the iterator (gRPC cancels the call) stops the producer."""
    queue: Queue = Queue(maxsize=depth)
    stop = threading.Event()
    done = object()

    def produce() -> None:
        try:
            for item in items:
                while not stop.is_set():
                    try:
                        queue.put(item, timeout=0.1)
                        break
                    except Full:
                        continue
                if stop.is_set():
                    return
            queue.put(done)
        except BaseException as err:  # handed to the consumer, raised there
            queue.put(err)

    producer = threading.Thread(target=produce, name="weight-encode", daemon=True)
    producer.start()
    try:
        while (item := queue.get()) is not done:
            if isinstance(item, BaseException):
                raise item
            yield item
    finally:
        stop.set()


class WeightPusher:
    """Pushes versions to many WeightSync servers at once. Channels are kept per address and reused."""

    def __init__(self, token: str | None = None, *, chunk_bytes: int = 4 << 20,
                 dtype: str | None = "float32", timeout_s: float = 60.0,
                 credentials: grpc.ChannelCredentials | None = None,
                 channel_options: Sequence[tuple[str, str]] = ()):
        if not 0 < chunk_bytes <= MAX_MESSAGE_BYTES:
            raise ValueError(f"push chunk_bytes must be in (0, {MAX_MESSAGE_BYTES}], got {chunk_bytes}")
        self.chunk_bytes, self.dtype, self.timeout_s = chunk_bytes, dtype, timeout_s
        self._metadata = ((AUTH_METADATA_KEY, f"Bearer {token}"),) if token else ()
        self._channels: dict[str, grpc.Channel] = {}
        self._channels_lock = threading.Lock()
        self._credentials, self._channel_options = credentials, list(channel_options)

    @classmethod
    def from_config(cls, cfg) -> WeightPusher:
        """From a `Config`: run.token, run.grpc_tls, learner.push_chunk_bytes / push_dtype / timeout_s."""
        from asyncrlhf.weights.tls import channel_credentials, channel_options

        tls = cfg.run.grpc_tls
        return cls(cfg.run.token, chunk_bytes=cfg.learner.push_chunk_bytes, dtype=cfg.learner.push_dtype,
                   timeout_s=cfg.learner.push_timeout_s, credentials=channel_credentials(tls),
                   channel_options=channel_options(tls))

    def push(self, state_dict: Mapping[str, torch.Tensor], version: int, targets: Sequence[PushTarget],
             *, partial: bool = False, lineage: int = 0) -> list[PushOutcome]:
        """Push `state_dict` as `version` of `lineage` to every target concurrently; one outcome per target,
        in order."""
        tensors = prepare(state_dict, self.dtype)
        return self.push_prepared(tensors, version, targets, partial=partial, lineage=lineage)

    def push_prepared(self, tensors: Sequence[WireTensor], version: int, targets: Sequence[PushTarget],
                      *, partial: bool = False, lineage: int = 0) -> list[PushOutcome]:
        if not targets:
            return []
        with ThreadPoolExecutor(max_workers=1, thread_name_prefix="weight-hash") as hasher, \
                ThreadPoolExecutor(max_workers=len(targets), thread_name_prefix="weight-push") as pool:
            checksums = [hasher.submit(checksum, t) for t in tensors]  # once, ahead of every sender
            futures = [pool.submit(self._push_one, tensors, version, t, partial, checksums, lineage)
                       for t in targets]
            return [f.result() for f in futures]

    def get_status(self, address: str, timeout_s: float = 5.0) -> pb.GetStatusReply:
        stub = pb_grpc.WeightSyncStub(self._channel(address))
        return stub.GetStatus(pb.GetStatusRequest(), timeout=timeout_s, metadata=self._metadata)

    def close(self) -> None:
        with self._channels_lock:
            for channel in self._channels.values():
                channel.close()
            self._channels.clear()

    def __enter__(self) -> WeightPusher:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def _push_one(
        self, tensors: Sequence[WireTensor], version: int, target: PushTarget, partial: bool,
        checksums: Sequence[Future[int]], lineage: int = 0,
    ) -> PushOutcome:
        push_weights = self._channel(target.address).stream_unary(  # requests pre-serialized: no serializer
            f"/{SERVICE}/PushWeights", response_deserializer=pb.PushReply.FromString)
        start = time.perf_counter()
        try:
            chunks = encoded_chunks(tensors, version, self.chunk_bytes, partial, checksums, lineage)
            requests = prefetched(chunks)
            reply = push_weights(requests,
                                 timeout=self.timeout_s, metadata=self._metadata)
        except grpc.RpcError as err:
            code = err.code()
            status: PushStatus = "unreachable" if code in _UNREACHABLE else "rejected"
            seconds = time.perf_counter() - start
            return PushOutcome(target, status, code.name, err.details() or "", 0, seconds, 0)
        return PushOutcome(target, "ok", "OK", "", reply.version, time.perf_counter() - start, reply.bytes)

    def _channel(self, address: str) -> grpc.Channel:
        with self._channels_lock:
            if address not in self._channels:
                options = [*GRPC_OPTIONS, *self._channel_options]
                self._channels[address] = (
                    grpc.secure_channel(address, self._credentials, options=options) if self._credentials
                    else grpc.insecure_channel(address, options=options))
            return self._channels[address]

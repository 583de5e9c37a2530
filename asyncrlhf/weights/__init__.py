"""Weight sync over gRPC: state dict <-> WeightChunk messages, the pushing client, and the receiving server.

Pushing side (learner): `WeightPusher.push(state_dict, version, targets)` casts floating tensors to the push
dtype once, checksums each tensor once (XXH3-64, in a background thread, shared by all targets) and streams
chunks to every target concurrently, each with its own deadline, encoding the next chunk while gRPC sends
this one; it returns one `PushOutcome` per target: ok, rejected (the receiver's reason) or unreachable.

Tensor bytes are the bulk of a push, so they are never copied through protobuf objects: `encode_chunk`
writes a WeightChunk as its small header message followed by the `data` field, and `decode_chunk` reads the
header with protobuf and hands `data` back as a view of the received buffer. The bytes on the wire are a
standard WeightChunk; any protobuf client or server interoperates.

Receiving side (generator): a `WeightReceiver` stages a push chunk by chunk, verifying every tensor against
the live model (`WeightTarget.named_tensors`: name, shape, dtype) and its checksum, and only on the commit
message hands the complete set to `WeightTarget.apply`, the atomic swap. Any problem raises `PushRejected`
before anything live is touched, so the receiver keeps serving its previous version bit for bit.
`WeightSyncServicer` maps proto <-> receiver; `serve` starts a gRPC server with token auth.
"""

from __future__ import annotations

import hmac
import threading
import time
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from queue import Full, Queue
from typing import Iterable, Iterator, Literal, Mapping, Protocol, Sequence

import grpc
import numpy as np
import torch
import xxhash

from asyncrlhf._proto import weights_pb2 as pb
from asyncrlhf._proto import weights_pb2_grpc as pb_grpc
from asyncrlhf.service import is_loopback

AUTH_METADATA_KEY = "authorization"
MAX_MESSAGE_BYTES = 64 << 20  # the largest chunk a server accepts; push_chunk_bytes must stay below
GRPC_OPTIONS = [
    ("grpc.max_receive_message_length", MAX_MESSAGE_BYTES + (1 << 20)),
    ("grpc.max_send_message_length", MAX_MESSAGE_BYTES + (1 << 20)),
]

_TO_WIRE: dict[torch.dtype, int] = {
    torch.float32: pb.DTYPE_FLOAT32,
    torch.bfloat16: pb.DTYPE_BFLOAT16,
    torch.float16: pb.DTYPE_FLOAT16,
    torch.int64: pb.DTYPE_INT64,
    torch.int32: pb.DTYPE_INT32,
    torch.uint8: pb.DTYPE_UINT8,
    torch.bool: pb.DTYPE_BOOL,
}
_FROM_WIRE: dict[int, torch.dtype] = {v: k for k, v in _TO_WIRE.items()}
PUSH_DTYPES: dict[str, torch.dtype] = {
    "float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16,
}


# ---------------------------------------------------------------------------------------------------------
# State dict -> chunks


@dataclass(frozen=True)
class WireTensor:
    """A tensor ready to send: cast, contiguous, on CPU, as raw bytes. Shared by every target of a push."""

    name: str
    dtype: int  # pb.DType
    shape: tuple[int, ...]
    data: memoryview  # raw bytes, C order
    tensor: torch.Tensor  # keeps `data` alive


def to_wire(name: str, tensor: torch.Tensor, cast: torch.dtype | None = None) -> WireTensor:
    """Prepare one tensor: floating tensors are cast to `cast` (if given), others are sent as they are."""
    t = tensor.detach()
    if cast is not None and t.is_floating_point():
        t = t.to(cast)
    t = t.to("cpu").contiguous()
    if t.dtype not in _TO_WIRE:
        supported = sorted(map(str, _TO_WIRE))
        raise ValueError(f"cannot push tensor `{name}` of dtype {t.dtype}; supported: {supported}")
    data = memoryview(t.reshape(-1).view(torch.uint8).numpy())
    return WireTensor(name, _TO_WIRE[t.dtype], tuple(t.shape), data, t)


def prepare(
    state_dict: Mapping[str, torch.Tensor], dtype: str | torch.dtype | None = None
) -> list[WireTensor]:
    """Every tensor of `state_dict` ready to send, floating ones cast to `dtype` ("bfloat16", ...)."""
    cast = PUSH_DTYPES[dtype] if isinstance(dtype, str) else dtype
    return [to_wire(name, tensor, cast) for name, tensor in state_dict.items()]


def adapter_tensors(state_dict: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Only the LoRA adapter tensors (PEFT names contain `lora_`): what a LoRA run pushes."""
    return {name: t for name, t in state_dict.items() if "lora_" in name}


def checksum(tensor: WireTensor) -> int:
    """XXH3-64 of a tensor's bytes as sent (the hash releases the GIL)."""
    return xxhash.xxh3_64_intdigest(tensor.data)


def encoded_chunks(
    tensors: Sequence[WireTensor], version: int, chunk_bytes: int, partial: bool = False,
    checksums: Sequence[Future[int]] | None = None,
) -> Iterator[bytes]:
    """The serialized WeightChunks of one push: each tensor in `chunk_bytes` slices (its checksum on the
    last), then the commit message. `checksums` (one per tensor, computed ahead in another thread and shared
    by every target of a push) keep hashing off the sending path; without them each is computed here."""
    if not 0 < chunk_bytes <= MAX_MESSAGE_BYTES:
        raise ValueError(f"chunk_bytes must be in (0, {MAX_MESSAGE_BYTES}], got {chunk_bytes}")
    for i, t in enumerate(tensors):
        nbytes = t.data.nbytes
        for offset in range(0, max(nbytes, 1), chunk_bytes):
            last = offset + chunk_bytes >= nbytes
            digest = (checksum(t) if checksums is None else checksums[i].result()) if last else 0
            header = pb.WeightChunk(version=version, name=t.name, dtype=t.dtype, shape=t.shape, offset=offset,
                                    checksum=digest)
            yield encode_chunk(header, t.data[offset:offset + chunk_bytes])
    commit = pb.WeightChunk(version=version, commit=True, tensor_count=len(tensors), partial=partial)
    yield commit.SerializeToString()


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


def chunks(
    tensors: Sequence[WireTensor], version: int, chunk_bytes: int, partial: bool = False
) -> Iterator[pb.WeightChunk]:
    """The same push as WeightChunk messages (for inspection and tests; the pusher sends `encoded_chunks`)."""
    return (pb.WeightChunk.FromString(raw) for raw in encoded_chunks(tensors, version, chunk_bytes, partial))


_DATA_FIELD = pb.WeightChunk.DESCRIPTOR.fields_by_name["data"].number
_DATA_TAG = bytes([_DATA_FIELD << 3 | 2])  # field 6, length-delimited


def encode_chunk(header: pb.WeightChunk, data: memoryview | bytes) -> bytes:
    """Serialize `header` with `data` as its `data` field, copying the bytes once."""
    return b"".join((header.SerializeToString(), _DATA_TAG, _varint(len(data)), data))


def decode_chunk(raw: bytes) -> tuple[pb.WeightChunk, memoryview]:
    """Parse a serialized WeightChunk into its header (everything but `data`) and a view of `data`."""
    view, pos, data, rest = memoryview(raw), 0, memoryview(b""), []
    while pos < len(raw):
        start = pos
        key, pos = _read_varint(raw, pos)
        field, wire_type = key >> 3, key & 7
        if wire_type == 0:
            _, pos = _read_varint(raw, pos)
        elif wire_type == 1:
            pos += 8
        elif wire_type == 5:
            pos += 4
        elif wire_type == 2:
            length, pos = _read_varint(raw, pos)
            if field == _DATA_FIELD:
                data, start = view[pos:pos + length], None
            pos += length
        else:
            raise ValueError(f"WeightChunk: unsupported wire type {wire_type}")
        if pos > len(raw):
            raise ValueError("WeightChunk: truncated message")
        if start is not None:
            rest.append(view[start:pos])
    return pb.WeightChunk.FromString(b"".join(rest)), data


def _varint(value: int) -> bytes:
    out = bytearray()
    while value >= 0x80:
        out.append(value & 0x7F | 0x80)
        value >>= 7
    out.append(value)
    return bytes(out)


def _read_varint(raw: bytes, pos: int) -> tuple[int, int]:
    value = shift = 0
    while True:
        if pos >= len(raw) or shift > 63:
            raise ValueError("WeightChunk: malformed varint")
        byte = raw[pos]
        value |= (byte & 0x7F) << shift
        pos, shift = pos + 1, shift + 7
        if byte < 0x80:
            return value, pos


# ---------------------------------------------------------------------------------------------------------
# Receiver


Reason = Literal[
    "unauthenticated", "stale_version", "unknown_tensor", "shape_mismatch", "dtype_mismatch", "bad_offset",
    "duplicate_tensor", "bad_checksum", "truncated", "tensor_count", "missing_tensors",
]


class PushRejected(Exception):
    """A push the receiver refuses; nothing live was changed."""

    def __init__(self, reason: Reason, message: str):
        super().__init__(f"{reason}: {message}")
        self.reason = reason


class WeightTarget(Protocol):
    """What a receiver updates: the live named tensors to validate against, and an atomic apply."""

    def named_tensors(self) -> Mapping[str, torch.Tensor]:
        """Name -> live tensor (only shape and dtype are read); a push may update exactly these names."""

    def apply(self, tensors: Mapping[str, torch.Tensor]) -> Mapping[str, torch.Tensor] | None:
        """Swap in the verified tensors all at once. They are CPU tensors with the live shapes, in the pushed
        dtype (a floating push dtype may differ from the live one: copy with a cast). Either copy them and
        return None (the receiver stages the next push into their memory, so keep no reference), or adopt
        some as live storage with no copy (`swap_in`) and return the tensors they replaced, which the model
        no longer uses and the receiver stages the next push into."""


def swap_in(
    live: Mapping[str, torch.Tensor], tensors: Mapping[str, torch.Tensor], adopt: bool = True
) -> dict[str, torch.Tensor]:
    """Make each of `tensors` the storage of the live tensor of the same name (`live[name].data = new`, no
    copy) where that is safe: same dtype and device, contiguous, storage not shared with another live name
    (tied weights); copy the rest (all of them when not `adopt`). Returns the replaced storages, by name, for
    the receiver to reuse."""
    owners: dict[int, int] = {}
    for t in live.values():
        owners[t.data_ptr()] = owners.get(t.data_ptr(), 0) + 1
    replaced: dict[str, torch.Tensor] = {}
    with torch.no_grad():
        for name, new in tensors.items():
            old = live[name]
            if (adopt and old.dtype == new.dtype and old.device == new.device and old.is_contiguous()
                    and new.is_contiguous() and owners[old.data_ptr()] == 1):
                replaced[name] = old.data
                old.data = new
            else:
                old.copy_(new)
    return replaced


class ModuleTarget:
    """A `WeightTarget` over a torch module's state dict (optionally only the names in `names`, e.g. LoRA
    adapters). `lock` is held while applying: a generator holds it around each generation batch, so a
    push lands between batches and never mid-group."""

    def __init__(self, module: torch.nn.Module, names: Iterable[str] | None = None):
        self.module = module
        self.lock = threading.Lock()
        state = module.state_dict(keep_vars=True)
        wanted = set(state) if names is None else set(names)
        missing = wanted - set(state)
        if missing:
            raise KeyError(f"ModuleTarget: the module has no tensors named {sorted(missing)[:5]}")
        self._live = {name: state[name] for name in state if name in wanted}

    def named_tensors(self) -> Mapping[str, torch.Tensor]:
        return self._live

    def apply(self, tensors: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        with self.lock:
            return swap_in(self._live, tensors)


@dataclass(frozen=True)
class PushResult:
    version: int
    tensor_count: int
    bytes: int
    apply_seconds: float


@dataclass(frozen=True)
class ReceiverStatus:
    version: int
    updated_at: float
    tensor_count: int


def _as_pairs(messages: Iterable) -> Iterator[tuple[pb.WeightChunk, memoryview]]:
    for message in messages:
        yield message if isinstance(message, tuple) else (message, memoryview(message.data))


class _Staging:
    """One tensor being received: a byte buffer filled in order, with a running checksum. Offsets are
    checked at once; the copy and the checksum run on `worker` (one thread, so in order) while the gRPC
    thread waits for the next chunk. `wait` before reading the buffer or reusing it."""

    def __init__(self, header: pb.WeightChunk, buffer: torch.Tensor, worker: ThreadPoolExecutor):
        self.name, self.dtype, self.shape = header.name, _FROM_WIRE[header.dtype], tuple(header.shape)
        self.buffer, self._view, self._worker = buffer, buffer.numpy(), worker
        self.nbytes, self.filled, self.digest, self.checksum = buffer.numel(), 0, xxhash.xxh3_64(), None
        self._pending: Future | None = None

    def add(self, header: pb.WeightChunk, data: memoryview) -> None:
        end = self.filled + len(data)
        if header.offset != self.filled or end > self.nbytes:
            where = f"chunk at byte {header.offset} (+{len(data)}) after {self.filled} of {self.nbytes} bytes"
            raise PushRejected("bad_offset", f"`{self.name}`: {where}; send chunks in order")
        self._pending = self._worker.submit(self._absorb, self.filled, end, data)
        self.filled = end
        if end == self.nbytes:
            self.checksum = header.checksum

    def _absorb(self, start: int, end: int, data: memoryview) -> None:
        self._view[start:end] = np.frombuffer(data, dtype=np.uint8)  # both release the GIL
        self.digest.update(data)

    def wait(self) -> None:
        if self._pending is not None:
            self._pending.result()

    def finish(self) -> torch.Tensor:
        self.wait()
        if self.filled != self.nbytes or self.checksum is None:
            raise PushRejected("truncated", f"`{self.name}`: got {self.filled} of {self.nbytes} bytes")
        got = self.digest.intdigest()
        if got != self.checksum:
            raise PushRejected("bad_checksum",
                               f"`{self.name}`: XXH3-64 {got:#018x}, expected {self.checksum:#018x}")
        return self.buffer.view(self.dtype).reshape(self.shape)


class WeightReceiver:
    """Stages pushes and applies each atomically on commit; pushes are handled one at a time. Staging
    buffers are kept between pushes (a second copy of the pushed tensors in CPU memory), so a push does
    not pay for fresh allocations."""

    def __init__(self, target: WeightTarget, version: int = 0):
        self.target = target
        self.version = version
        self.updated_at = 0.0
        self._lock = threading.Lock()
        self._buffers: dict[str, torch.Tensor] = {}
        self._worker = ThreadPoolExecutor(max_workers=1, thread_name_prefix="weight-stage")
        self.incoming_version: int | None = None

    def status(self) -> ReceiverStatus:
        return ReceiverStatus(self.version, self.updated_at, len(self.target.named_tensors()))

    def receive(self, messages: Iterable[tuple[pb.WeightChunk, memoryview] | pb.WeightChunk]) -> PushResult:
        """Consume one push of (header, data) pairs (see `decode_chunk`) or plain WeightChunks; raise
        `PushRejected` (old weights intact) or return once the new version is live. While a push is being
        received, `incoming_version` is its version."""
        with self._lock:
            try:
                return self._receive(_as_pairs(messages))
            finally:
                self.incoming_version = None

    def _receive(self, messages: Iterable[tuple[pb.WeightChunk, memoryview]]) -> PushResult:
        live = self.target.named_tensors()
        staged: dict[str, torch.Tensor] = {}
        current: _Staging | None = None
        version: int | None = None
        received = 0
        try:
            for header, data in messages:
                version = self._check_version(header, version)
                if header.commit:
                    if current is not None:
                        staged[current.name] = current.finish()
                    return self._commit(header, live, staged, received)
                if current is None or header.name != current.name:
                    if current is not None:
                        staged[current.name] = current.finish()
                    current = self._start(header, live, staged)
                current.add(header, data)
                received += len(data)
        finally:
            if current is not None:
                current.wait()  # no copy may still write into a buffer the next push reuses
        where = f" in `{current.name}`" if current is not None else ""
        raise PushRejected("truncated", f"the stream ended before the commit message{where}")

    def _check_version(self, header: pb.WeightChunk, version: int | None) -> int:
        if version is None:
            if header.version <= self.version:
                raise PushRejected("stale_version",
                                   f"version {header.version} is not newer than {self.version}")
            self.incoming_version = header.version
            return header.version
        if header.version != version:
            raise PushRejected("stale_version",
                               f"version changed mid-push from {version} to {header.version}")
        return version

    def _start(self, header: pb.WeightChunk, live: Mapping[str, torch.Tensor], staged: Mapping) -> _Staging:
        name = header.name
        if name not in live:
            raise PushRejected("unknown_tensor", f"`{name}` is not a tensor of this model")
        if name in staged:
            raise PushRejected("duplicate_tensor", f"`{name}` was sent twice in one push")
        target = live[name]
        if tuple(header.shape) != tuple(target.shape):
            raise PushRejected("shape_mismatch",
                               f"`{name}`: pushed {list(header.shape)}, live {list(target.shape)}")
        wire = _FROM_WIRE.get(header.dtype)
        castable = wire is not None and wire.is_floating_point and target.dtype.is_floating_point
        if wire != target.dtype and not castable:
            raise PushRejected("dtype_mismatch",
                               f"`{name}`: pushed {pb.DType.Name(header.dtype)}, live {target.dtype}")
        nbytes = target.numel() * wire.itemsize
        buffer = self._buffers.get(name)
        if buffer is None or buffer.numel() != nbytes:
            buffer = self._buffers[name] = torch.empty(nbytes, dtype=torch.uint8)
        return _Staging(header, buffer, self._worker)

    def _commit(
        self, header: pb.WeightChunk, live: Mapping, staged: dict[str, torch.Tensor], received: int
    ) -> PushResult:
        if header.tensor_count != len(staged):
            raise PushRejected("tensor_count",
                               f"commit says {header.tensor_count} tensors, received {len(staged)}")
        missing = set(live) - set(staged)
        if missing and not header.partial:
            example = min(missing)
            raise PushRejected("missing_tensors", f"{len(missing)} live tensors not sent (e.g. `{example}`); "
                                                  "mark the commit partial to update only some")
        start = time.perf_counter()
        replaced = self.target.apply(staged) or {}
        for name, old in replaced.items():  # adopted buffers are live now; stage the next push into these
            self._buffers[name] = old.detach().reshape(-1).view(torch.uint8)
        self.version, self.updated_at = header.version, time.time()
        return PushResult(header.version, len(staged), received, time.perf_counter() - start)


# ---------------------------------------------------------------------------------------------------------
# gRPC server


_STATUS: dict[str, grpc.StatusCode] = {
    "unauthenticated": grpc.StatusCode.UNAUTHENTICATED,
    "stale_version": grpc.StatusCode.FAILED_PRECONDITION,
    "unknown_tensor": grpc.StatusCode.NOT_FOUND,
    "shape_mismatch": grpc.StatusCode.INVALID_ARGUMENT,
    "dtype_mismatch": grpc.StatusCode.INVALID_ARGUMENT,
    "bad_offset": grpc.StatusCode.INVALID_ARGUMENT,
    "duplicate_tensor": grpc.StatusCode.INVALID_ARGUMENT,
    "tensor_count": grpc.StatusCode.INVALID_ARGUMENT,
    "missing_tensors": grpc.StatusCode.INVALID_ARGUMENT,
    "bad_checksum": grpc.StatusCode.DATA_LOSS,
    "truncated": grpc.StatusCode.DATA_LOSS,
}


class WeightSyncServicer(pb_grpc.WeightSyncServicer):
    """Maps the WeightSync RPCs onto a `WeightReceiver`; rejections become status codes via `_STATUS`."""

    def __init__(self, receiver: WeightReceiver):
        self.receiver = receiver

    def PushWeights(self, request_iterator: Iterator[tuple[pb.WeightChunk, memoryview]],
                    context: grpc.ServicerContext) -> pb.PushReply:
        try:
            result = self.receiver.receive(request_iterator)
        except PushRejected as err:
            context.abort(_STATUS[err.reason], str(err))
        return pb.PushReply(version=result.version, tensor_count=result.tensor_count, bytes=result.bytes,
                            apply_seconds=result.apply_seconds)

    def GetStatus(self, request: pb.GetStatusRequest, context: grpc.ServicerContext) -> pb.GetStatusReply:
        status = self.receiver.status()
        return pb.GetStatusReply(version=status.version, updated_at=status.updated_at,
                                 tensor_count=status.tensor_count)


class TokenAuthInterceptor(grpc.ServerInterceptor):
    """Refuses every call whose `authorization` metadata is not `Bearer <token>` with UNAUTHENTICATED."""

    def __init__(self, token: str):
        self._expected = f"Bearer {token}".encode()

    def intercept_service(self, continuation, handler_call_details):
        sent = dict(handler_call_details.invocation_metadata or ()).get(AUTH_METADATA_KEY, "")
        if hmac.compare_digest(str(sent).encode(), self._expected):
            return continuation(handler_call_details)
        handler = continuation(handler_call_details)
        message = "unauthenticated: missing or wrong token (set run.token or ASYNCRLHF_TOKEN on both sides)"

        def deny(_request, context):
            context.abort(grpc.StatusCode.UNAUTHENTICATED, message)

        if handler is None:
            return None
        if handler.request_streaming and not handler.response_streaming:
            return grpc.stream_unary_rpc_method_handler(deny)
        if not handler.request_streaming and not handler.response_streaming:
            return grpc.unary_unary_rpc_method_handler(deny)
        return grpc.stream_stream_rpc_method_handler(deny) if handler.request_streaming else \
            grpc.unary_stream_rpc_method_handler(deny)


def serve(
    receiver: WeightReceiver,
    host: str = "127.0.0.1",
    port: int = 0,
    token: str | None = None,
    *,
    allow_insecure_bind: bool = False,
    max_workers: int = 4,
) -> tuple[grpc.Server, int]:
    """Start a WeightSync server for `receiver`; returns the server and its bound port."""
    if token is None and not allow_insecure_bind and not is_loopback(host):
        raise ValueError(f"refusing to serve WeightSync on {host} without a token: set run.token (or "
                         "ASYNCRLHF_TOKEN), bind 127.0.0.1, or set run.allow_insecure_bind=true")
    interceptors = [TokenAuthInterceptor(token)] if token else []
    server = grpc.server(ThreadPoolExecutor(max_workers=max_workers), interceptors=interceptors,
                         options=GRPC_OPTIONS)
    add_to_server(WeightSyncServicer(receiver), server)
    bound = server.add_insecure_port(f"{host}:{port}")
    if bound == 0:
        raise OSError(f"cannot bind WeightSync to {host}:{port}")
    server.start()
    return server, bound


def add_to_server(servicer: pb_grpc.WeightSyncServicer, server: grpc.Server) -> None:
    """Register `servicer` like the generated `add_WeightSyncServicer_to_server`, except that PushWeights
    decodes with `decode_chunk`, so its request iterator yields (header, data view) pairs: no copy of the
    tensor bytes through protobuf objects."""
    server.add_generic_rpc_handlers((grpc.method_handlers_generic_handler(_SERVICE, {
        "PushWeights": grpc.stream_unary_rpc_method_handler(
            servicer.PushWeights, request_deserializer=decode_chunk,
            response_serializer=pb.PushReply.SerializeToString),
        "GetStatus": grpc.unary_unary_rpc_method_handler(
            servicer.GetStatus, request_deserializer=pb.GetStatusRequest.FromString,
            response_serializer=pb.GetStatusReply.SerializeToString),
    }),))


_SERVICE = pb.DESCRIPTOR.services_by_name["WeightSync"].full_name


# ---------------------------------------------------------------------------------------------------------
# Pushing client


@dataclass(frozen=True)
class PushTarget:
    id: str
    address: str  # host:port of the generator's WeightSync server


@dataclass(frozen=True)
class PushOutcome:
    """What happened to one target: `ok`, `rejected` (the receiver refused; `detail` says why) or
    `unreachable` (no answer within the deadline)."""

    target: PushTarget
    status: Literal["ok", "rejected", "unreachable"]
    code: str  # gRPC status code name ("OK", "DATA_LOSS", "UNAVAILABLE", ...)
    detail: str
    version: int  # the version the target now serves, when ok
    seconds: float
    bytes: int


_UNREACHABLE = {grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED}


class WeightPusher:
    """Pushes versions to many WeightSync servers at once. Channels are kept per address and reused."""

    def __init__(self, token: str | None = None, *, chunk_bytes: int = 4 << 20,
                 dtype: str | None = "float32", timeout_s: float = 60.0):
        if not 0 < chunk_bytes <= MAX_MESSAGE_BYTES:
            raise ValueError(f"push chunk_bytes must be in (0, {MAX_MESSAGE_BYTES}], got {chunk_bytes}")
        self.chunk_bytes, self.dtype, self.timeout_s = chunk_bytes, dtype, timeout_s
        self._metadata = ((AUTH_METADATA_KEY, f"Bearer {token}"),) if token else ()
        self._channels: dict[str, grpc.Channel] = {}
        self._channels_lock = threading.Lock()

    @classmethod
    def from_config(cls, cfg) -> "WeightPusher":
        """From a `Config`: run.token, learner.push_chunk_bytes / push_dtype / push_timeout_s."""
        return cls(cfg.run.token, chunk_bytes=cfg.learner.push_chunk_bytes, dtype=cfg.learner.push_dtype,
                   timeout_s=cfg.learner.push_timeout_s)

    def push(self, state_dict: Mapping[str, torch.Tensor], version: int, targets: Sequence[PushTarget],
             *, partial: bool = False) -> list[PushOutcome]:
        """Push `state_dict` as `version` to every target concurrently; one outcome per target, in order."""
        tensors = prepare(state_dict, self.dtype)
        return self.push_prepared(tensors, version, targets, partial=partial)

    def push_prepared(self, tensors: Sequence[WireTensor], version: int, targets: Sequence[PushTarget],
                      *, partial: bool = False) -> list[PushOutcome]:
        if not targets:
            return []
        with ThreadPoolExecutor(max_workers=1, thread_name_prefix="weight-hash") as hasher, \
                ThreadPoolExecutor(max_workers=len(targets), thread_name_prefix="weight-push") as pool:
            checksums = [hasher.submit(checksum, t) for t in tensors]  # once, ahead of every sender
            futures = [pool.submit(self._push_one, tensors, version, t, partial, checksums) for t in targets]
            return [f.result() for f in futures]

    def get_status(self, address: str, timeout_s: float = 5.0) -> pb.GetStatusReply:
        stub = pb_grpc.WeightSyncStub(self._channel(address))
        return stub.GetStatus(pb.GetStatusRequest(), timeout=timeout_s, metadata=self._metadata)

    def close(self) -> None:
        with self._channels_lock:
            for channel in self._channels.values():
                channel.close()
            self._channels.clear()

    def __enter__(self) -> "WeightPusher":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def _push_one(
        self, tensors: Sequence[WireTensor], version: int, target: PushTarget, partial: bool,
        checksums: Sequence[Future[int]],
    ) -> PushOutcome:
        push_weights = self._channel(target.address).stream_unary(  # requests pre-serialized: no serializer
            f"/{_SERVICE}/PushWeights", response_deserializer=pb.PushReply.FromString)
        start = time.perf_counter()
        try:
            requests = prefetched(encoded_chunks(tensors, version, self.chunk_bytes, partial, checksums))
            reply = push_weights(requests,
                                 timeout=self.timeout_s, metadata=self._metadata)
        except grpc.RpcError as err:
            code = err.code()
            status = "unreachable" if code in _UNREACHABLE else "rejected"
            seconds = time.perf_counter() - start
            return PushOutcome(target, status, code.name, err.details() or "", 0, seconds, 0)
        return PushOutcome(target, "ok", "OK", "", reply.version, time.perf_counter() - start, reply.bytes)

    def _channel(self, address: str) -> grpc.Channel:
        with self._channels_lock:
            if address not in self._channels:
                self._channels[address] = grpc.insecure_channel(address, options=GRPC_OPTIONS)
            return self._channels[address]


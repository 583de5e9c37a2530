"""The pushing side (learner): one version to many WeightSync servers at once.

`WeightPusher.push(state_dict, version, targets)` casts floating tensors to the push dtype once and pushes to
every target concurrently, each with its own deadline; it returns one `PushOutcome` per target: ok, rejected
(the receiver's reason) or unreachable. Each version is prepared once per path, whatever the number of
targets: targets that share this host's shared memory (their GetStatus says so, asked once per address) get
the bytes through the pusher's shared-memory segments (`shm`: written once per version, adopted in place by
the receivers, rewritten once none holds them, removed at `close`) and only control messages over gRPC; the
others that offer a data channel (`channel.py`; GetStatus says its port) get the bytes over it, from the
tensors' own memory, and only control messages over gRPC; the rest get one byte stream, encoded and
checksummed (XXH3-64, while encoding) ahead of gRPC sending it — once for all of them
(`stream.EncodedOnce`). A target that cannot open the segment, or whose data channel cannot be reached, is
streamed to from then on (a data channel: until it is asked again, after a failed connection).

With `relay_fanout` k > 0 the streamed targets form a relay tree (`relay.py`): the pusher streams to k of
them, and each generator that commits the version forwards it to its part of the tree, so this pusher's
upload stays about k versions whatever the number of targets; it waits for every relayed target to serve the
version and pushes directly to any whose relay failed. `send` is one round of pushes, each target's commit
message carrying its part of the tree.
"""

from __future__ import annotations

import contextlib
import functools
import logging
import ssl
import threading
import time
from collections.abc import Iterator, Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from queue import Full, Queue
from typing import Literal

import grpc
import torch

from asyncrlhf._proto import weights_pb2 as pb
from asyncrlhf._proto import weights_pb2_grpc as pb_grpc
from asyncrlhf.weights.channel import push_beside, split_address
from asyncrlhf.weights.codec import MAX_MESSAGE_BYTES, WireTensor, commit_message, encoded_chunks, prepare
from asyncrlhf.weights.routes import UNREACHABLE, Routes
from asyncrlhf.weights.server import AUTH_METADATA_KEY, GRPC_OPTIONS, SERVICE
from asyncrlhf.weights.shm import SegmentPool, ShmPublication, layout, shm_host, sweep_stale
from asyncrlhf.weights.stream import EncodedOnce

log = logging.getLogger(__name__)
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
    bytes: int  # tensor bytes this pusher sent the target (0: it got the version from a relay)
    relayed_by: str = ""  # the id of the generator that forwarded the version to it ("": this pusher did)
    path: str = ""  # how the version reached it, when ok: "shm", "data", "stream" or "relay"


PROBE_TIMEOUT_S = 2.0  # GetStatus asking a new target whether it shares our shared memory


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


def _shm_requests(publication: ShmPublication, partial: bool, timeout_s: float) -> Iterator[bytes]:
    """The control messages of a same-host push: one per tensor as its bytes land in the segment, then the
    commit."""
    for i in range(len(publication.tensors)):
        yield publication.control(i, timeout_s).SerializeToString()
    commit = commit_message(publication.version, publication.lineage, len(publication.tensors), partial)
    yield commit.SerializeToString()


def _with_commit(requests: Iterator[bytes], commit: bytes) -> Iterator[bytes]:
    """`requests` with its last message (the commit) replaced by `commit`: one target's own commit (its relay
    plan) after the chunks every target shares."""
    held: bytes | None = None
    for request in requests:
        if held is not None:
            yield held
        held = request
    yield commit


# A target -> the targets it relays the version to once committed (its part of the tree), or none.
RelayPlan = Mapping[PushTarget, Sequence[PushTarget]]


class WeightPusher:
    """Pushes versions to many WeightSync servers at once. Channels are kept per address and reused."""

    def __init__(self, token: str | None = None, *, chunk_bytes: int = 4 << 20,
                 dtype: str | None = "float32", timeout_s: float = 60.0,
                 credentials: grpc.ChannelCredentials | None = None,
                 channel_options: Sequence[tuple[str, str]] = (), shm: bool = True, relay_fanout: int = 0,
                 data_channel: bool = True, data_tls: ssl.SSLContext | None = None,
                 data_server_name: str | None = None):
        """`data_tls` (`tls.client_ssl_context`): the data channel's TLS, needed to use one beside TLS
        `credentials`; `data_server_name`: the name its certificate must carry (else the host dialed)."""
        if not 0 < chunk_bytes <= MAX_MESSAGE_BYTES:
            raise ValueError(f"push chunk_bytes must be in (0, {MAX_MESSAGE_BYTES}], got {chunk_bytes}")
        if relay_fanout < 0:
            raise ValueError(f"relay_fanout must be >= 0 (0: no relay), got {relay_fanout}")
        self.chunk_bytes, self.dtype, self.timeout_s = chunk_bytes, dtype, timeout_s
        self.relay_fanout = relay_fanout
        self._metadata = ((AUTH_METADATA_KEY, f"Bearer {token}"),) if token else ()
        self._channels: dict[str, grpc.Channel] = {}
        self._channels_lock = threading.Lock()
        self._credentials, self._channel_options = credentials, list(channel_options)
        self._data_tls, self._data_server_name = data_tls, data_server_name
        # beside TLS gRPC only a TLS data channel: without its context, bytes stay on the TLS stream
        self.routes = Routes(functools.partial(self.get_status, timeout_s=min(PROBE_TIMEOUT_S, timeout_s)),
                             shm_host() if shm else "",
                             data_channel and (credentials is None or data_tls is not None))
        self._segments = SegmentPool()  # rewritten in place, each once no receiver holds it
        self._segment_lock = threading.Lock()
        if self.routes.shm_host:
            sweep_stale()  # segments of a pusher that was killed mid-push

    @classmethod
    def from_config(cls, cfg) -> WeightPusher:
        """From a `Config`: run.token, run.grpc_tls, learner.push_chunk_bytes / push_dtype / timeout_s /
        relay_fanout."""
        from asyncrlhf.weights.tls import channel_credentials, channel_options, client_ssl_context

        tls = cfg.run.grpc_tls
        return cls(cfg.run.token, chunk_bytes=cfg.learner.push_chunk_bytes, dtype=cfg.learner.push_dtype,
                   timeout_s=cfg.learner.push_timeout_s, credentials=channel_credentials(tls),
                   channel_options=channel_options(tls), relay_fanout=cfg.learner.relay_fanout,
                   data_tls=client_ssl_context(tls), data_server_name=tls.server_name if tls else None)

    def push(self, state_dict: Mapping[str, torch.Tensor], version: int, targets: Sequence[PushTarget],
             *, partial: bool = False, lineage: int = 0) -> list[PushOutcome]:
        """Push `state_dict` as `version` of `lineage` to every target concurrently; one outcome per target,
        in order."""
        tensors = prepare(state_dict, self.dtype)
        return self.push_prepared(tensors, version, targets, partial=partial, lineage=lineage)

    def push_prepared(self, tensors: Sequence[WireTensor], version: int, targets: Sequence[PushTarget],
                      *, partial: bool = False, lineage: int = 0) -> list[PushOutcome]:
        if self.relay_fanout:
            from asyncrlhf.weights.relay import TreePush  # relay.py builds on this module

            return TreePush(self, tensors, version, partial, lineage).run(targets)
        return self.send(tensors, version, targets, partial=partial, lineage=lineage)

    def paths(self, targets: Sequence[PushTarget]) -> list[str]:
        """How a push reaches each target: "shm", "data", "stream" or "unreachable:<code>" (`Routes.path`)."""
        if not targets:
            return []
        with ThreadPoolExecutor(max_workers=len(targets), thread_name_prefix="weight-probe") as pool:
            return list(pool.map(self.routes.path, [t.address for t in targets]))

    def send(self, tensors: Sequence[WireTensor], version: int, targets: Sequence[PushTarget], *,
             partial: bool = False, lineage: int = 0, relay: RelayPlan | None = None, relay_fanout: int = 0,
             paths: Sequence[str] | None = None) -> list[PushOutcome]:
        """One round: push to every target concurrently, no relay tree of its own; a target in `relay` is
        asked to forward the version, once committed, to its targets there, `relay_fanout` at a time.
        `paths`: from `paths(targets)`, when known."""
        if not targets:
            return []
        relay = relay or {}
        with ThreadPoolExecutor(max_workers=len(targets), thread_name_prefix="weight-push") as pool:
            if paths is None:
                paths = list(pool.map(self.routes.path, [t.address for t in targets]))
            streamed, local = paths.count("stream"), "shm" in paths  # "data": each its own connection
            # one version in the segment at a time; pushes that do not use it run side by side
            with self._segment_lock if local else contextlib.nullcontext():
                segment = self._publish_locally(tensors, version, lineage) if local else None
                shared = EncodedOnce(tensors, version, self.chunk_bytes, partial, lineage=lineage) \
                    if streamed > 1 else None
                try:
                    futures = []
                    for t, path in zip(targets, paths, strict=True):
                        below = [(b.id, b.address) for b in relay.get(t, ())]
                        commit = commit_message(version, lineage, len(tensors), partial, below,
                                                relay_fanout).SerializeToString() if below else None
                        futures.append(pool.submit(self._push_one, tensors, version, t, partial, path,
                                                   segment, shared, lineage, commit))
                    return [f.result() for f in futures]
                finally:
                    if segment is not None:
                        segment.finish()
                        self._segments.trim(segment.segment, receivers=self.routes.local_receivers())
                    if shared is not None:
                        shared.close()

    def _publish_locally(self, tensors: Sequence[WireTensor], version: int, lineage: int) -> ShmPublication:
        """Write `version` into a segment no local receiver holds (`SegmentPool.claim`)."""
        _, size = layout(tensors)
        return ShmPublication(tensors, version, self._segments.claim(size), lineage)

    def get_status(self, address: str, timeout_s: float = 5.0) -> pb.GetStatusReply:
        stub = pb_grpc.WeightSyncStub(self._channel(address))
        return stub.GetStatus(pb.GetStatusRequest(), timeout=timeout_s, metadata=self._metadata)

    def close(self) -> None:
        with self._channels_lock:
            for channel in self._channels.values():
                channel.close()
            self._channels.clear()
        with self._segment_lock:
            self._segments.close()  # no segment outlives its pusher

    def __enter__(self) -> WeightPusher:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def _push_one(
        self, tensors: Sequence[WireTensor], version: int, target: PushTarget, partial: bool, path: str,
        segment: ShmPublication | None, shared: EncodedOnce | None, lineage: int = 0,
        commit: bytes | None = None,
    ) -> PushOutcome:
        start = time.perf_counter()
        if path.startswith("unreachable:"):  # "unreachable:<the status code GetStatus got>"
            code_name = path.split(":", 1)[1]
            return PushOutcome(target, "unreachable", code_name, "no answer to GetStatus", 0, 0.0, 0)
        if path == "data":
            return self._push_over_channel(tensors, version, target, partial, lineage, commit)
        push_weights = self._channel(target.address).stream_unary(  # requests pre-serialized: no serializer
            f"/{SERVICE}/PushWeights", response_deserializer=pb.PushReply.FromString)
        if segment is not None and path == "shm":
            requests: Iterator[bytes] = _shm_requests(segment, partial, self.timeout_s)
        elif shared is not None:
            requests = shared.reader()
        else:
            requests = prefetched(encoded_chunks(tensors, version, self.chunk_bytes, partial, lineage))
        if commit is not None:
            requests = _with_commit(requests, commit)
        try:
            reply = push_weights(requests, timeout=self.timeout_s, metadata=self._metadata)
        except grpc.RpcError as err:
            code = err.code()
            if path == "shm" and (err.details() or "").startswith("shm_unavailable"):
                self.routes.no_shm(target.address)
                return self._push_one(tensors, version, target, partial, "stream", None, None, lineage,
                                      commit)
            status: PushStatus = "unreachable" if code in UNREACHABLE else "rejected"
            seconds = time.perf_counter() - start
            return PushOutcome(target, status, code.name, err.details() or "", 0, seconds, 0)
        return PushOutcome(target, "ok", "OK", "", reply.version, time.perf_counter() - start, reply.bytes,
                           path=path)

    def _push_over_channel(self, tensors: Sequence[WireTensor], version: int, target: PushTarget,
                           partial: bool, lineage: int, commit: bytes | None) -> PushOutcome:
        """Control over gRPC, bytes over the target's data channel (`channel.push_beside`). A channel that
        cannot be opened, or that the receiver cannot pair with the push, gets the byte stream."""
        start, address, port = time.perf_counter(), target.address, self.routes.data_port(target.address)
        push_weights = self._channel(address).stream_unary(
            f"/{SERVICE}/PushWeights", response_deserializer=pb.PushReply.FromString)

        def call(requests: Iterator[bytes]) -> pb.PushReply:
            return push_weights(requests, timeout=self.timeout_s, metadata=self._metadata)

        final = commit or commit_message(version, lineage, len(tensors), partial).SerializeToString()
        try:
            reply = push_beside(call, split_address(address), port, tensors, version, lineage, final,
                                self.timeout_s, self._data_tls, self._data_server_name)
            seconds = time.perf_counter() - start
            return PushOutcome(target, "ok", "OK", "", reply.version, seconds, reply.bytes, path="data")
        except OSError as err:
            log.warning("weight data channel of %s (port %d) unreachable (%s): pushing over the gRPC stream",
                        address, port, err)
            self.routes.forget(address)
        except grpc.RpcError as err:
            if not (err.details() or "").startswith("channel_unavailable"):
                status: PushStatus = "unreachable" if err.code() in UNREACHABLE else "rejected"
                return PushOutcome(target, status, err.code().name, err.details() or "", 0,
                                   time.perf_counter() - start, 0)
            self.routes.no_data(address)
        return self._push_one(tensors, version, target, partial, "stream", None, None, lineage, commit)

    def _channel(self, address: str) -> grpc.Channel:
        with self._channels_lock:
            if address not in self._channels:
                options = [*GRPC_OPTIONS, *self._channel_options]
                self._channels[address] = (
                    grpc.secure_channel(address, self._credentials, options=options) if self._credentials
                    else grpc.insecure_channel(address, options=options))
            return self._channels[address]

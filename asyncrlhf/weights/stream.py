"""The gRPC byte stream route (`Route.STREAM`): tensor bytes inside the PushWeights messages, the route every
generator can take and the one the others fall back to.

`StreamSender` encodes a version once for every streamed target of a round: `EncodedOnce` runs
`codec.encoded_chunks` (slices, checksums computed while encoding) in one background thread and keeps the
serialized chunks for the length of the push; each target's gRPC call reads them with its own cursor
(`reader`), so N targets cost one encoding, and a slow or dead target never holds up the others (the encoder
runs ahead of the fastest reader by `depth` chunks, not of the slowest). The price is one encoded copy of the
push in memory until the push ends; a push to a single target streams through `prefetched` instead, two
chunks ahead. `StreamSource` hands the receiver each message's bytes as a view of the received buffer
(`Inline`).
"""

from __future__ import annotations

import functools
import threading
from collections.abc import Iterator
from contextlib import nullcontext
from queue import Full, Queue

import numpy as np
import xxhash

from asyncrlhf._proto import weights_pb2 as pb
from asyncrlhf.weights.access import PushCall
from asyncrlhf.weights.codec import Snapshot, copy_hashed, encoded_chunks
from asyncrlhf.weights.routes import RouteSpec, SenderSettings, register
from asyncrlhf.weights.vocabulary import Route


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


def with_commit(requests: Iterator[bytes], commit: bytes) -> Iterator[bytes]:
    """`requests` with its last message (the commit) replaced by `commit`: one target's own commit (its relay
    plan) after the chunks every target shares."""
    held: bytes | None = None
    for request in requests:
        if held is not None:
            yield held
        held = request
    yield commit


class EncodedOnce:
    def __init__(self, push: Snapshot, chunk_bytes: int, depth: int = 4):
        self._source = encoded_chunks(push, chunk_bytes)
        self._chunks: list[bytes] = []
        self._furthest = 0  # the fastest reader's cursor
        self._depth = depth
        self._finished = False
        self._closed = False
        self._error: BaseException | None = None
        self._cond = threading.Condition()
        self._encoder = threading.Thread(target=self._encode, name="weight-encode-once", daemon=True)
        self._encoder.start()

    def _encode(self) -> None:
        try:
            for chunk in self._source:
                with self._cond:
                    self._cond.wait_for(self._room)
                    if self._closed:
                        return
                    self._chunks.append(chunk)
                    self._cond.notify_all()
        except BaseException as err:  # handed to every reader, raised there
            self._error = err
        with self._cond:
            self._finished = True
            self._cond.notify_all()

    def _room(self) -> bool:
        return self._closed or len(self._chunks) < self._furthest + self._depth

    def _ready(self, i: int) -> bool:
        return i < len(self._chunks) or self._finished or self._closed

    def reader(self) -> Iterator[bytes]:
        """Every chunk of the push, in order, for one target."""
        i = 0
        while True:
            with self._cond:
                self._cond.wait_for(functools.partial(self._ready, i))
                if i < len(self._chunks):
                    chunk = self._chunks[i]
                    self._furthest = max(self._furthest, i + 1)
                    self._cond.notify_all()
                elif self._error is not None:
                    raise self._error
                else:
                    return
            yield chunk
            i += 1

    def close(self) -> None:
        """Stop encoding and drop the chunks (every target's call has ended)."""
        with self._cond:
            self._closed = True
            self._chunks = []
            self._cond.notify_all()
        self._encoder.join()


class StreamTransfer:
    """One version streamed to the targets of a round: encoded once when there are several."""

    def __init__(self, push: Snapshot, chunk_bytes: int, targets: int):
        self.push, self.chunk_bytes = push, chunk_bytes
        self._shared = EncodedOnce(push, chunk_bytes) if targets > 1 else None

    def send_weights(self, call: PushCall, address: str, commit: bytes) -> pb.PushReply:
        chunks = self._shared.reader() if self._shared is not None else \
            prefetched(encoded_chunks(self.push, self.chunk_bytes))
        return call(with_commit(chunks, commit))

    def close(self) -> None:
        if self._shared is not None:
            self._shared.close()


class StreamSender:
    """The learner end of `Route.STREAM`: every generator takes it."""

    route = Route.STREAM

    def __init__(self, chunk_bytes: int):
        self.chunk_bytes = chunk_bytes

    def accepts(self, address: str, status: pb.GetStatusReply) -> bool:
        return True

    def forget(self, address: str) -> None:
        """Nothing is kept per generator."""

    def begin(self, push: Snapshot, targets: int) -> StreamTransfer:
        return StreamTransfer(push, self.chunk_bytes, targets)

    def close(self) -> None:
        """Nothing is kept across rounds."""


class Inline:
    """A message's bytes inside the gRPC message: a view of the received buffer."""

    def __init__(self, data: memoryview):
        self.data, self.nbytes = data, len(data)

    def copy_into(self, dst: np.ndarray, digest: xxhash.xxh3_64) -> None:
        copy_hashed(dst, self.data, digest)

    def abort(self) -> None:
        """Nothing to stop: the bytes are here."""


class StreamSource:
    """The generator end of `Route.STREAM`: whatever no other route claims carries its bytes inline."""

    route = Route.STREAM

    def payload(self, header: pb.WeightChunk, inline: memoryview) -> Inline:
        return Inline(inline)


def _sender(settings: SenderSettings) -> StreamSender:
    return StreamSender(settings.chunk_bytes)


def _source(end: None) -> nullcontext[StreamSource]:
    return nullcontext(StreamSource())


register(RouteSpec(Route.STREAM, _sender, lambda header: True, _source, preference=100))

"""The gRPC byte stream route (`Route.STREAM`): tensor bytes inside the PushWeights messages, the route every
generator can take and the one the others fall back to.

`Encoded` runs `codec.encoded_chunks` (slices, checksums computed while encoding) in a background thread,
`depth` chunks ahead of the fastest reader, so that encoding the next chunk overlaps gRPC sending this one;
each target's call reads the chunks with its own cursor (`reader`), then sends its own commit (which may
carry its part of a relay tree). A version streamed to several targets of a round is encoded once for all of
them (`StreamTransfer`) and its chunks are kept for the length of the push, so N targets cost one encoding
and a slow or dead target never holds up the others; the price is one encoded copy of the push in memory
until the push ends. A single target (or one that fell back to the stream) gets an encoding of its own whose
chunks are let go as it reads them. `StreamSource` hands the receiver each message's bytes as a view of the
received buffer (`Inline`).
"""

from __future__ import annotations

import functools
import itertools
import threading
from collections.abc import Iterator
from contextlib import nullcontext

import numpy as np
import xxhash

from asyncrlhf._proto import weights_pb2 as pb
from asyncrlhf.weights.access import PushCall
from asyncrlhf.weights.codec import Snapshot, copy_hashed, encoded_chunks
from asyncrlhf.weights.routes import RouteSpec, SenderSettings, register
from asyncrlhf.weights.vocabulary import Route


class Encoded:
    """The tensor messages of one push, encoded ahead of their readers (see the module); `keep`: every reader
    starts from the first chunk (else one reader, and each chunk is let go once read)."""

    def __init__(self, push: Snapshot, chunk_bytes: int, depth: int, keep: bool):
        self._source = encoded_chunks(push, chunk_bytes)
        self._chunks: list[bytes | None] = []
        self._furthest = 0  # the fastest reader's cursor
        self._depth, self._keep = depth, keep
        self._finished = False
        self._closed = False
        self._error: BaseException | None = None
        self._cond = threading.Condition()
        self._encoder = threading.Thread(target=self._encode, name="weight-encode", daemon=True)
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
        """Every tensor message of the push, in order, for one target."""
        i = 0
        while True:
            with self._cond:
                self._cond.wait_for(functools.partial(self._ready, i))
                if i < len(self._chunks):
                    chunk = self._chunks[i]
                    if not self._keep:
                        self._chunks[i] = None
                    self._furthest = max(self._furthest, i + 1)
                    self._cond.notify_all()
                elif self._error is not None:
                    raise self._error
                else:
                    return
            assert chunk is not None, "a chunk let go was read again: a reader of its own reads once"
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
        self._shared = Encoded(push, chunk_bytes, depth=4, keep=True) if targets > 1 else None

    def send_weights(self, call: PushCall, address: str, commit: bytes) -> pb.PushReply:
        encoded = self._shared or Encoded(self.push, self.chunk_bytes, depth=2, keep=False)
        try:
            return call(itertools.chain(encoded.reader(), (commit,)))
        finally:
            if encoded is not self._shared:
                encoded.close()

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

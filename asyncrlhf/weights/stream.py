"""The cross-host byte stream of one version, encoded once for every target that gets it.

`EncodedOnce` runs `codec.encoded_chunks` (slices, checksums computed while encoding) in one background
thread and keeps the serialized chunks for the length of the push; each target's gRPC call reads them with
its own cursor (`reader`), so N targets cost one encoding, and a slow or dead target never holds up the
others (the encoder runs ahead of the fastest reader by `depth` chunks, not of the slowest). The price is one
encoded copy of the push in memory until the push ends; a push to a single target streams through
`pusher.prefetched` instead, two chunks ahead.
"""

from __future__ import annotations

import functools
import threading
from collections.abc import Iterator, Sequence

from asyncrlhf.weights.codec import WireTensor, encoded_chunks


class EncodedOnce:
    def __init__(self, tensors: Sequence[WireTensor], version: int, chunk_bytes: int, partial: bool = False,
                 depth: int = 4, lineage: int = 0):
        self._source = encoded_chunks(tensors, version, chunk_bytes, partial, lineage)
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

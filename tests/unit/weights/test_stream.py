"""The stream route without a network: one encoding per version for every streamed target (same bytes as
`encoded_chunks`, readers independent), and the encoding ahead of sending for one target."""

from __future__ import annotations

import time

import pytest
import torch

from asyncrlhf.version import PolicyVersion
from asyncrlhf.weights.codec import Snapshot, encoded_chunks, prepare
from asyncrlhf.weights.stream import EncodedOnce, prefetched

pytestmark = pytest.mark.unit


def tensors() -> Snapshot:
    torch.manual_seed(0)
    return Snapshot(PolicyVersion(0, 3), prepare({"a": torch.randn(300), "b": torch.randn(7, 5)}))


def test_every_reader_gets_the_same_chunks_as_one_encoding():
    want = list(encoded_chunks(tensors(), 256))
    shared = EncodedOnce(tensors(), 256, depth=2)
    try:
        assert list(shared.reader()) == want
        assert list(shared.reader()) == want  # a late reader starts from the first chunk
    finally:
        shared.close()


def test_a_reader_that_stops_does_not_hold_up_another():
    shared = EncodedOnce(tensors(), 64, depth=1)
    try:
        stuck = shared.reader()
        next(stuck)  # a target that stopped reading after its first chunk (a hung generator)
        assert len(list(shared.reader())) == len(list(encoded_chunks(tensors(), 64)))
    finally:
        shared.close()


def test_an_encoding_error_reaches_every_reader():
    shared = EncodedOnce(tensors(), 0)  # chunk_bytes out of range: the encoder raises
    try:
        for _ in range(2):
            with pytest.raises(ValueError, match="chunk_bytes"):
                list(shared.reader())
    finally:
        shared.close()


def test_prefetched_keeps_order_raises_source_errors_and_stops_when_closed():
    assert list(prefetched(iter([b"a", b"b", b"c"]))) == [b"a", b"b", b"c"]

    def failing():
        yield b"a"
        raise ValueError("encoder broke")

    it = prefetched(failing())
    assert next(it) == b"a"
    with pytest.raises(ValueError, match="encoder broke"):
        next(it)

    produced = []

    def endless():
        while True:
            produced.append(1)
            yield b"x"

    it = prefetched(endless(), depth=2)
    next(it)
    it.close()  # what gRPC does to a cancelled call's request iterator
    time.sleep(0.3)
    settled = len(produced)
    time.sleep(0.3)
    assert len(produced) == settled <= 5  # the producer stopped, a few items ahead at most

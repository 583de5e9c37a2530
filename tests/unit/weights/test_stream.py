"""The stream route without a network: one encoding per version for every streamed target (same bytes as
`encoded_chunks`, readers independent), and a target's own encoding, ahead of its sending."""

from __future__ import annotations

import time

import pytest
import torch

from asyncrlhf.version import PolicyVersion
from asyncrlhf.weights.codec import Snapshot, encoded_chunks, prepare
from asyncrlhf.weights.stream import Encoded

pytestmark = pytest.mark.unit


def tensors() -> Snapshot:
    torch.manual_seed(0)
    return Snapshot(PolicyVersion(0, 3), prepare({"a": torch.randn(300), "b": torch.randn(7, 5)}))


def test_every_reader_gets_the_same_chunks_as_one_encoding():
    want = list(encoded_chunks(tensors(), 256))
    shared = Encoded(tensors(), 256, depth=2, keep=True)
    try:
        assert list(shared.reader()) == want
        assert list(shared.reader()) == want  # a late reader starts from the first chunk
    finally:
        shared.close()


def test_a_reader_that_stops_does_not_hold_up_another():
    shared = Encoded(tensors(), 64, depth=1, keep=True)
    try:
        stuck = shared.reader()
        next(stuck)  # a target that stopped reading after its first chunk (a hung generator)
        assert len(list(shared.reader())) == len(list(encoded_chunks(tensors(), 64)))
    finally:
        shared.close()


def test_an_encoding_error_reaches_every_reader():
    shared = Encoded(tensors(), 0, depth=4, keep=True)  # chunk_bytes out of range: the encoder raises
    try:
        for _ in range(2):
            with pytest.raises(ValueError, match="chunk_bytes"):
                list(shared.reader())
    finally:
        shared.close()


def test_a_reader_of_its_own_keeps_order_raises_encoder_errors_and_lets_chunks_go():
    want = list(encoded_chunks(tensors(), 64))
    own = Encoded(tensors(), 64, depth=2, keep=False)
    try:
        assert list(own.reader()) == want
        assert own._chunks == [None] * len(want)  # nothing kept once read
    finally:
        own.close()
    failing = Encoded(tensors(), 0, depth=2, keep=False)
    try:
        with pytest.raises(ValueError, match="chunk_bytes"):
            list(failing.reader())
    finally:
        failing.close()


def test_closing_stops_the_encoder_a_few_chunks_ahead():
    own = Encoded(tensors(), 16, depth=2, keep=False)
    reader = own.reader()
    next(reader)
    time.sleep(0.2)
    assert len(own._chunks) <= 3  # the encoder waits `depth` ahead of the reader
    own.close()  # what the transfer does once the call ended (gRPC cancelled it)
    assert not own._encoder.is_alive()
    assert list(reader) == []

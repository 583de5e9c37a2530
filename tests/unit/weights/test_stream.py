"""One encoding per version for every streamed target: same bytes as `encoded_chunks`, readers independent."""

from __future__ import annotations

import pytest
import torch

from asyncrlhf.weights.codec import WireTensor, encoded_chunks, prepare
from asyncrlhf.weights.stream import EncodedOnce

pytestmark = pytest.mark.unit


def tensors() -> list[WireTensor]:
    torch.manual_seed(0)
    return prepare({"a": torch.randn(300), "b": torch.randn(7, 5)})


def test_every_reader_gets_the_same_chunks_as_one_encoding():
    want = list(encoded_chunks(tensors(), 3, 256))
    shared = EncodedOnce(tensors(), 3, 256, depth=2)
    try:
        assert list(shared.reader()) == want
        assert list(shared.reader()) == want  # a late reader starts from the first chunk
    finally:
        shared.close()


def test_a_reader_that_stops_does_not_hold_up_another():
    shared = EncodedOnce(tensors(), 3, 64, depth=1)
    try:
        stuck = shared.reader()
        next(stuck)  # a target that stopped reading after its first chunk (a hung generator)
        assert len(list(shared.reader())) == len(list(encoded_chunks(tensors(), 3, 64)))
    finally:
        shared.close()


def test_an_encoding_error_reaches_every_reader():
    shared = EncodedOnce(tensors(), 3, 0)  # chunk_bytes out of range: the encoder raises
    try:
        for _ in range(2):
            with pytest.raises(ValueError, match="chunk_bytes"):
                list(shared.reader())
    finally:
        shared.close()

"""The pusher's encoding ahead of sending, without a network."""

from __future__ import annotations

import time

import pytest

from asyncrlhf.weights.pusher import prefetched

pytestmark = pytest.mark.unit


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

"""Who may use the backend when: generation batches (the loop, `/v1/completions`) and weight swaps take
turns, one at a time, and a waiting swap goes before the next batch. So a push lands between batches,
never mid-group, and a busy loop cannot starve it."""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Iterator


class BackendGate:
    def __init__(self) -> None:
        self._cond = threading.Condition()
        self._busy = False
        self._swaps_waiting = 0

    @property
    def swaps_waiting(self) -> int:
        with self._cond:
            return self._swaps_waiting

    @contextlib.contextmanager
    def generating(self) -> Iterator[None]:
        """Hold the backend for one generation batch (waits for any pending swap first)."""
        with self._cond:
            self._cond.wait_for(lambda: not self._busy and self._swaps_waiting == 0)
            self._busy = True
        try:
            yield
        finally:
            self._release()

    @contextlib.contextmanager
    def swapping(self) -> Iterator[None]:
        """Hold the backend to swap weights (waits for the batch in progress, then goes first)."""
        with self._cond:
            self._swaps_waiting += 1
            try:
                self._cond.wait_for(lambda: not self._busy)
            finally:
                self._swaps_waiting -= 1
            self._busy = True
        try:
            yield
        finally:
            self._release()

    def _release(self) -> None:
        with self._cond:
            self._busy = False
            self._cond.notify_all()

"""Who may use the backend when. Generation batches of two kinds share one backend: the training loop's
("loop") and the HTTP API's ("api"). Weight swaps share it too. One holder at a time:

- a waiting swap goes before the next batch of either kind (a push lands between batches, never mid-group,
  and a busy generator cannot starve it);
- when a loop batch and an API batch both wait, they take turns: the kind that did not go last goes next.
  A stream of API requests therefore delays each training batch by at most one API batch, and a busy
  training loop still lets one API batch through between its own;
- at most `max_waiting` API batches wait; one more is refused with `GateBusy` (the API answers 429).

The gate knows nothing about versions: a batch sees one version from start to end because swaps wait for it.
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Iterator
from typing import Literal

Kind = Literal["loop", "api"]


class GateBusy(RuntimeError):
    """Too many API batches already wait for the backend."""


class BackendGate:
    def __init__(self, max_api_waiting: int = 8) -> None:
        self._cond = threading.Condition()
        self._busy = False
        self._swaps_waiting = 0
        self._waiting: dict[Kind, int] = {"loop": 0, "api": 0}
        self._last: Kind | None = None
        self.max_api_waiting = max_api_waiting

    @property
    def swaps_waiting(self) -> int:
        with self._cond:
            return self._swaps_waiting

    def waiting(self, kind: Kind) -> int:
        with self._cond:
            return self._waiting[kind]

    @contextlib.contextmanager
    def generating(self, kind: Kind = "loop") -> Iterator[None]:
        """Hold the backend for one generation batch of `kind` (waits for any pending swap, and for the
        other kind's turn when it waits too). Raises GateBusy when `max_api_waiting` API batches wait."""
        other: Kind = "api" if kind == "loop" else "loop"
        with self._cond:
            if kind == "api" and self._waiting["api"] >= self.max_api_waiting:
                raise GateBusy(f"{self._waiting['api']} API requests already wait for the backend")
            self._waiting[kind] += 1
            try:
                self._cond.wait_for(lambda: not self._busy and self._swaps_waiting == 0
                                    and not (self._waiting[other] and self._last == kind))
            finally:
                self._waiting[kind] -= 1
            self._busy, self._last = True, kind
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

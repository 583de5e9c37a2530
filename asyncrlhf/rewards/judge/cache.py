"""The judge's cache: the value each judged request came to, keyed by the hash of what the judge was asked
(its model and the rendered template: prompt, completion(s), reference), least recently used out first.

Decoding is greedy, so the same request gets the same reply: a repeat (a group re-delivered after a
reward replica died, a group re-scored alone after its batch failed, the same answer sampled twice) costs
no call. A parse failure is cached too (the judge would fail it again); a call that got no reply is not.
"""

from __future__ import annotations

import hashlib
import threading
from collections import OrderedDict


def request_key(identity: str, mode: str, rendered: str) -> str:
    """The cache key of one judge request: sha256 of the judge's model, how the reply is read, the prompt."""
    return hashlib.sha256("\0".join((identity, mode, rendered)).encode()).hexdigest()


class VerdictCache:
    """key -> value (None: the reply did not parse), at most `size` entries; size 0 keeps nothing."""

    def __init__(self, size: int):
        self.size = size
        self._entries: OrderedDict[str, float | None] = OrderedDict()
        self._lock = threading.Lock()

    def get(self, key: str) -> tuple[bool, float | None]:
        """(found, value)."""
        with self._lock:
            if key not in self._entries:
                return False, None
            self._entries.move_to_end(key)
            return True, self._entries[key]

    def put(self, key: str, value: float | None) -> None:
        if self.size == 0:
            return
        with self._lock:
            self._entries[key] = value
            self._entries.move_to_end(key)
            while len(self._entries) > self.size:
                self._entries.popitem(last=False)

    def __len__(self) -> int:
        return len(self._entries)

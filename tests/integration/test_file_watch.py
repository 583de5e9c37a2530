"""The watch the no-file-per-version tests keep on /dev/shm counts what this test process and its descendants
write, not what another process on the host writes there at the same moment (another test's vLLM engine
making its own psm_* segments on the other worker: the failure CI saw)."""

from __future__ import annotations

import subprocess
import sys
import time
from multiprocessing import shared_memory

import pytest
from watchdog.observers import Observer

from tests.integration.vllm.helpers import Writes

pytestmark = pytest.mark.integration

# Makes a segment, says its name, and holds it until its stdin closes.
MAKER = ("import sys; from multiprocessing import shared_memory as s;"
         " m = s.SharedMemory(create=True, size=4096);"
         " print(m.name, flush=True); sys.stdin.read(); m.close(); m.unlink()")


def _wait_for(writes: Writes, *names: str) -> list[str]:
    deadline, seen = time.monotonic() + 10, []
    while time.monotonic() < deadline and not all(any(n in e for e in seen) for n in names):
        time.sleep(0.1)
        seen += writes.take()
    return seen


def test_a_segment_another_process_tree_makes_is_not_counted_and_ours_are():
    writes, observer = Writes(), Observer()
    observer.schedule(writes, "/dev/shm", recursive=False)
    observer.start()
    # outside our tree: the maker's parent shell exits at once, so the maker is adopted by another process
    # (its stdin through fd 3: a shell gives a background command /dev/null for stdin)
    detached = f"exec 3<&0; {sys.executable} -c '{MAKER}' <&3 &"
    other = subprocess.Popen(["sh", "-c", detached], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    child = subprocess.Popen([sys.executable, "-c", MAKER], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                             text=True)
    try:
        theirs = other.stdout.readline().strip()
        child_segment = child.stdout.readline().strip()
        ours = shared_memory.SharedMemory(create=True, size=4096)
        try:
            seen = _wait_for(writes, ours.name, child_segment)
        finally:
            ours.close()
            ours.unlink()
    finally:
        for p in (other, child):
            p.stdin.close()
        child.wait(10)
        observer.stop()
        observer.join()
    assert theirs and not any(theirs in e for e in seen), seen
    assert any(f"created /dev/shm/{ours.name}" == e for e in seen), seen
    assert any(f"created /dev/shm/{child_segment}" == e for e in seen), seen


# a new segment every 20 ms, each held for a second (as long-lived as an engine's, for the judging), until its
# stdin closes: then it removes what it holds
CHURN = ("import collections, select, sys; from multiprocessing import shared_memory as s\n"
         "held = collections.deque(); print('churning', flush=True)\n"
         "while not select.select([sys.stdin], [], [], 0.02)[0]:\n"
         "    held.append(s.SharedMemory(create=True, size=4096))\n"
         "    if len(held) > 50: m = held.popleft(); m.close(); m.unlink()\n"
         "for m in held: m.close(); m.unlink()\n")


def test_our_writes_are_seen_while_another_process_churns_segments(tmp_path):
    """Judging another's segment reads /proc: done beside the observer, so it goes on taking our events
    meanwhile; and `settle` waits until the observer has taken them all (it drops those it has not read
    when it stops: CI saw a file hop's push file missed so)."""
    writes, observer = Writes(), Observer()
    observer.schedule(writes, "/dev/shm", recursive=False)
    observer.schedule(writes, str(tmp_path), recursive=False)
    detached = f"exec 3<&0; {sys.executable} -c \"{CHURN}\" <&3 &"
    other = subprocess.Popen(["sh", "-c", detached], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    assert other.stdout.readline().strip() == "churning"
    observer.start()
    try:
        time.sleep(2)  # a backlog of its segments' events
        (tmp_path / "push.safetensors").write_bytes(b"x" * 1024)
        writes.settle(tmp_path)
    finally:
        observer.stop()
        observer.join()
        other.stdin.close()
    seen = writes.take()
    assert f"created {tmp_path / 'push.safetensors'}" in seen, seen[-20:]
    assert not any(e.startswith(("created /dev/shm/psm_", "deleted /dev/shm/psm_")) for e in seen), seen[-20:]


def test_a_file_opened_and_closed_in_the_watch_without_a_write_is_not_counted_and_a_write_is(tmp_path):
    """A close is not a write: another process attaching to a segment that existed before the watch opens
    and closes it, and may be gone before it could be judged another's."""
    existing = tmp_path / "segment"
    existing.write_bytes(b"\0" * 16)
    writes, observer = Writes(), Observer()
    observer.schedule(writes, str(tmp_path), recursive=False)
    observer.start()
    try:
        with existing.open("r+b"):
            pass  # opened for writing, closed without a write: an inotify close-write event
        writes.settle(tmp_path)
        assert writes.take() == []
        with existing.open("r+b") as f:
            f.write(b"\1")
        writes.settle(tmp_path)
        assert f"modified {existing}" in writes.take()
    finally:
        observer.stop()
        observer.join()

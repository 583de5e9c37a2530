"""The same-host data plane: a push's bytes through shared-memory segments, written once per version and
adopted in place by every local receiver.

When a receiver sees the pusher's shared memory (`shm_host()` equal on both sides: the same boot and the same
/dev/shm mount), gRPC carries only the control of a push — one WeightChunk per tensor with its name, dtype,
shape, checksum and place in the segment (`shm_segment`, `shm_offset`), then the commit — and the bytes go
through a file in /dev/shm that the pusher writes once per version for all its local receivers:

    pusher (this module)                             each local receiver (`shm_read`)
    SegmentPool.claim: a segment no receiver holds   Lease: map the segment privately; per tensor, read-lock
    ShmPublication: write tensor i, unlock it, then    its bytes, hash them where they lie (XXH3-64), and view
      release its control message -- gRPC -------->    them as the tensor: no copy; swap on commit; the live
    finish(), after every local push ends               model keeps the lock for as long as it uses the bytes

The locks are open-file-description byte-range locks (`F_OFD_SETLK`): a receiver read-locks each tensor's
bytes before it hashes them and holds the lock while its live tensors are views of them; the pusher
write-locks a whole segment before rewriting it (`claim`), which fails while any receiver holds any of it,
and unlocks each tensor's bytes once written. So verified bytes never change under a live model, and a
receiver reading a segment that a newer version is overwriting is refused (`stale_version`) and keeps its
version. The kernel drops a process's locks when it dies, however it dies: a killed generator holds nothing.
Versions therefore alternate between two segments (one more per receiver that still serves an older one);
segments are rewritten, never made per version (a fresh tmpfs file writes about ten times slower than a
rewrite, measured here: page allocation), and each receiver keeps its mapping of a segment from version to
version (`shm_read.SegmentMaps`). The receiver's private mapping means a write into a live view (a tensor
copied into its storage) copies that page for the receiver and never reaches the segment.

Guarantees are those of the byte stream: staged, verified, atomic swap; a rejected push leaves the old
version serving; nothing is unpickled. The pusher's segments (`SegmentPool`) live as long as it does; a
pusher killed before closing them leaves files whose liveness lock (`flock`) is gone, which `sweep_stale`
(run by every new pusher: the restarted learner) removes — a receiver still serving from one keeps its
mapping until it moves on.

A GPU backend slots in at the same two points (docs/weights.md): a publication whose control messages name
a CUDA IPC handle (or an NCCL broadcast round) instead of a file, and a reader that resolves them to device
memory; the receiver's verification and swap stay as they are.
"""

from __future__ import annotations

import errno
import fcntl
import mmap
import os
import re
import secrets
import struct
import threading
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np
import xxhash

from asyncrlhf._proto import weights_pb2 as pb
from asyncrlhf.weights.codec import WireTensor, copy_hashed

SHM_DIR = Path("/dev/shm")
PREFIX = "asyncrlhf-w-"
SEGMENT_NAME = re.compile(rf"^{PREFIX}(\d+)-[0-9a-f]+$")  # asyncrlhf-w-<pid>-<random>
_ALIGN = 64
# struct flock (Linux, 64-bit off_t): l_type, l_whence, l_start, l_len, l_pid (0 for OFD locks), padding
_FLOCK = struct.Struct("hhqqi4x")
_OFD = hasattr(fcntl, "F_OFD_SETLK")  # Linux >= 3.15


def shm_host() -> str:
    """Who shares this process's /dev/shm: the boot id and the mount's device; "" where there is none (or no
    open-file-description locks, which guard the segments)."""
    try:
        boot = Path("/proc/sys/kernel/random/boot_id").read_text().strip()
        st = SHM_DIR.stat()
    except OSError:
        return ""
    if not os.access(SHM_DIR, os.W_OK) or not _OFD:
        return ""
    return f"{boot}:{st.st_dev}"


def sweep_stale(directory: Path = SHM_DIR) -> list[str]:
    """Remove the segments of pushers that died (SIGKILL, OOM) before closing them; the names removed.

    A live pusher holds an exclusive `flock` on each of its segments for as long as it has it
    (`ShmSegment`), and the kernel drops the lock when the process dies, however it dies. So a segment whose
    lock can be taken is an orphan. The lock, not the pid in the name, decides: /dev/shm is shared across PID
    namespaces (containers with `ipc: host` or a mounted /dev/shm), where a pid means nothing to this
    process. A segment this process may not open or remove (another user's) is left as it is. (`flock` and
    the byte-range locks of pushes are independent.)"""
    removed = []
    for path in directory.glob(f"{PREFIX}*") if directory.is_dir() else ():
        if SEGMENT_NAME.match(path.name) and _orphan(path):
            try:
                path.unlink()
                removed.append(path.name)
            except (FileNotFoundError, PermissionError):
                pass
    return removed


def _orphan(path: Path) -> bool:
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:  # gone already, or not ours to read
        return False
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:  # its pusher is alive
        return False
    except OSError:
        return False
    finally:
        os.close(fd)  # releases the lock just taken, if any
    return True


def range_lock(fd: int, kind: int, start: int, length: int) -> bool:
    """Set an open-file-description lock (`fcntl.F_RDLCK`, `F_WRLCK` or `F_UNLCK`) on bytes
    [start, start + length) of `fd` (length 0: to the end, however the file grows), without waiting; False
    if another open description holds a conflicting one."""
    try:
        fcntl.fcntl(fd, fcntl.F_OFD_SETLK, _FLOCK.pack(kind, os.SEEK_SET, start, length, 0))
    except OSError as err:
        if err.errno in (errno.EAGAIN, errno.EACCES):
            return False
        raise
    return True


def layout(tensors: Sequence[WireTensor]) -> tuple[list[int], int]:
    """Each tensor's offset in a segment (64-byte aligned) and the segment size they need."""
    offsets, size = [], 0
    for t in tensors:
        offsets.append(size)
        size += _padded(t.data.nbytes)
    return offsets, max(size, 1)


def _padded(nbytes: int) -> int:
    return -(-nbytes // _ALIGN) * _ALIGN


class ShmSegment:
    """A file in /dev/shm (mode 0600) mapped read-write: one of the pusher's, rewritten in place version after
    version. `claim` before writing a version into it; `close` removes it; a pusher killed before that leaves
    it to `sweep_stale`."""

    def __init__(self, size: int, directory: Path = SHM_DIR):
        self.size = size
        fd = self._create_locked(directory)
        try:
            os.ftruncate(fd, size)
            self.map = mmap.mmap(fd, size)
        except BaseException:
            self.path.unlink(missing_ok=True)
            os.close(fd)
            raise
        self._lock_fd = fd

    def _create_locked(self, directory: Path) -> int:
        """A new segment file, locked (held while this process lives: `sweep_stale` leaves it alone). A sweep
        that took the lock in the instant between creating and locking has removed the name: start again."""
        for _ in range(8):
            self.name = f"{PREFIX}{os.getpid()}-{secrets.token_hex(4)}"
            self.path = directory / self.name
            fd = os.open(self.path, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600)
            fcntl.flock(fd, fcntl.LOCK_EX)
            try:
                if os.stat(self.path).st_ino == os.fstat(fd).st_ino:
                    return fd
            except FileNotFoundError:
                pass
            os.close(fd)
        raise OSError(f"could not create a shared-memory segment in {directory}: every new name was swept")

    def claim(self) -> bool:
        """Write-lock the whole segment to write a new version into it; False while any receiver holds any of
        its bytes (its live weights are views of them)."""
        return range_lock(self._lock_fd, fcntl.F_WRLCK, 0, 0)

    def unlock(self, start: int = 0, length: int = 0) -> None:
        """Let receivers lock bytes [start, start + length) (length 0: to the end): they are written."""
        range_lock(self._lock_fd, fcntl.F_UNLCK, start, length)

    def close(self) -> None:
        self.path.unlink(missing_ok=True)
        if self._lock_fd >= 0:
            os.close(self._lock_fd)
            self._lock_fd = -1
        try:
            self.map.close()
        except BufferError:  # a view is still alive somewhere; the mapping goes with it
            pass


class SegmentPool:
    """The pusher's segments. Each version goes into one that no receiver holds (`claim`): with every local
    receiver moving to each version, two alternate; one more is made while some receiver still serves from
    both. `trim` closes the idle ones beyond `keep`: each local receiver serves from at most one segment, so
    a pusher that knows G of them keeps G + 1, and a version that some receiver skipped (it was pushed to the
    others) finds a segment to go into instead of a new one: a fresh tmpfs file writes about ten times slower
    than a rewrite."""

    def __init__(self, keep: int = 2, directory: Path = SHM_DIR):
        self.keep, self.directory = keep, directory
        self.segments: list[ShmSegment] = []

    def claim(self, size: int) -> ShmSegment:
        """A segment of at least `size` bytes, write-locked for this process: an idle one, else a new one."""
        for segment in list(self.segments):
            if segment.claim():
                if segment.size >= size:
                    return segment
                self._drop(segment)  # too small, and nobody holds it
        segment = ShmSegment(size, self.directory)
        if not segment.claim():
            segment.close()
            raise OSError(f"a new shared-memory segment {segment.name} could not be locked")
        self.segments.append(segment)
        return segment

    def trim(self, current: ShmSegment, receivers: int = 1) -> None:
        """Close idle segments (no receiver holds them) while more than `keep` (at least `receivers` + 1)
        are left, `current` aside."""
        keep = max(self.keep, receivers + 1)
        for segment in reversed(list(self.segments)):
            if len(self.segments) <= keep:
                return
            if segment is not current and segment.claim():
                self._drop(segment)

    def _drop(self, segment: ShmSegment) -> None:
        self.segments.remove(segment)
        segment.close()

    def close(self) -> None:
        for segment in list(self.segments):
            self._drop(segment)


class ShmPublication:
    """One version's tensors written into a claimed `segment` tensor by tensor by a background thread, each
    hashed (XXH3-64) as written, from the segment, while in cache, then unlocked for receivers; `control(i)`
    (blocking until tensor i is written) is the message that hands it to a receiver. `finish` once every local
    push of the version has ended, before the segment is claimed again or closed."""

    def __init__(self, tensors: Sequence[WireTensor], version: int, segment: ShmSegment, lineage: int = 0):
        self.tensors, self.version, self.segment, self.lineage = tensors, version, segment, lineage
        self.offsets, size = layout(tensors)
        if size > segment.size:
            raise ValueError(f"segment {segment.name} holds {segment.size} bytes; this version needs {size}")
        self.name = segment.name
        self._map = segment.map
        self._checksums = [0] * len(tensors)
        self._written = [threading.Event() for _ in tensors]
        self._error: BaseException | None = None
        self._writer = threading.Thread(target=self._write_all, name="weight-shm-write", daemon=True)
        self._writer.start()

    def _write_all(self) -> None:
        try:
            whole = np.frombuffer(self._map, dtype=np.uint8)
            for i, t in enumerate(self.tensors):
                start, n = self.offsets[i], t.data.nbytes
                if n:
                    digest = xxhash.xxh3_64()
                    copy_hashed(whole[start:start + n], t.data, digest)
                    self._checksums[i] = digest.intdigest()
                    self.segment.unlock(start, _padded(n))
                self._written[i].set()
            del whole
        except BaseException as err:  # handed to every sender, raised there
            self._error = err
            for event in self._written:
                event.set()
        finally:
            self.segment.unlock()

    def control(self, i: int, timeout_s: float | None = None) -> pb.WeightChunk:
        """The control message of tensor `i`, once its bytes are in the segment."""
        if not self._written[i].wait(timeout_s):
            raise TimeoutError(f"shared-memory segment {self.name}: tensor {i} not written in {timeout_s} s")
        if self._error is not None:
            raise RuntimeError(f"writing shared-memory segment {self.name} failed: {self._error}")
        t = self.tensors[i]
        dtype: Any = t.dtype  # a pb.DType value
        return pb.WeightChunk(version=self.version, lineage=self.lineage, name=t.name, dtype=dtype,
                              shape=t.shape, offset=0,
                              checksum=self._checksums[i], shm_segment=self.name,
                              shm_offset=self.offsets[i])

    def finish(self) -> None:
        self._writer.join()

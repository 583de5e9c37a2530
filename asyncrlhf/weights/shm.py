"""The shared-memory route (`Route.SHM`), learner end: a push's bytes through segments in /dev/shm, written
once per version and adopted in place by every receiver on the learner's host (`shm_read` is the generator
end). gRPC carries one control message per tensor (name, dtype, shape, checksum, its place in the segment)
and the commit.

The segments are rewritten version after version rather than made per version (a fresh tmpfs file allocates
its pages on every write); versions alternate between them. Open-file-description byte-range locks guard
them: a receiver read-locks each tensor's bytes before verifying them and keeps the lock while its live
tensors view them; the pusher write-locks a whole segment before rewriting it (`claim`), which fails while
any receiver holds any of it. So verified bytes never change under a live model, a receiver reading a
segment a newer version is overwriting refuses (`stale_version`), and a killed process holds nothing (the
kernel drops its locks). A pusher killed before closing its segments leaves files whose liveness `flock` is
gone, which the next pusher removes (`sweep_stale`). docs/weights.md has the design and its measurements.
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
from collections.abc import Iterator, Sequence
from pathlib import Path

import numpy as np
import xxhash

from asyncrlhf._proto import weights_pb2 as pb
from asyncrlhf.weights.access import PushCall
from asyncrlhf.weights.codec import Snapshot, WireTensor, copy_hashed, tensor_header
from asyncrlhf.weights.vocabulary import Route

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
    others) finds a segment to go into instead of a new one rather than a fresh file."""

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
    hashed (XXH3-64) as written, from the segment, while in cache (a tensor whose checksum is known, one a
    relay verified, keeps it), then unlocked for receivers; `control(i)` (blocking until tensor i is written)
    is the message that hands it to a receiver. `finish` once every local push of the version has ended,
    before the segment is claimed again or closed."""

    def __init__(self, push: Snapshot, segment: ShmSegment):
        self.push, self.tensors, self.segment = push, push.tensors, segment
        self.offsets, size = layout(self.tensors)
        if size > segment.size:
            raise ValueError(f"segment {segment.name} holds {segment.size} bytes; this version needs {size}")
        self.name = segment.name
        self._map = segment.map
        self._checksums = [t.checksum or 0 for t in self.tensors]  # known ones (a delta's) even if empty
        self._written = [threading.Event() for _ in self.tensors]
        self._error: BaseException | None = None
        self._writer = threading.Thread(target=self._write_all, name="weight-shm-write", daemon=True)
        self._writer.start()

    def _write_all(self) -> None:
        try:
            whole = np.frombuffer(self._map, dtype=np.uint8)
            for i, t in enumerate(self.tensors):
                start, n = self.offsets[i], t.data.nbytes
                if n:
                    self._checksums[i] = _write(whole[start:start + n], t)
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
        return tensor_header(self.push.version, self.tensors[i], checksum=self._checksums[i],
                             shm_segment=self.name, shm_offset=self.offsets[i])

    def finish(self) -> None:
        self._writer.join()


def _write(dst: np.ndarray, t: WireTensor) -> int:
    """dst[:] = t's bytes; their checksum: t's own if known, else XXH3-64 of the bytes as written."""
    if t.checksum is not None:
        dst[:] = np.frombuffer(t.data, dtype=np.uint8)
        return t.checksum
    digest = xxhash.xxh3_64()
    copy_hashed(dst, t.data, digest)
    return digest.intdigest()


class ShmTransfer:
    """One version in a segment for the local targets of a round; the sender's segment lock is held until
    `close`: one version in the segments at a time."""

    def __init__(self, sender: ShmSender, publication: ShmPublication):
        self.sender, self.publication = sender, publication

    def requests(self, commit: bytes) -> Iterator[bytes]:
        """Each tensor's control message as its bytes land in the segment, then `commit`."""
        for i in range(len(self.publication.tensors)):
            yield self.publication.control(i, self.sender.timeout_s).SerializeToString()
        yield commit

    def send_weights(self, call: PushCall, address: str, commit: bytes) -> pb.PushReply:
        return call(self.requests(commit))

    def close(self) -> None:
        self.publication.finish()
        self.sender.done(self.publication.segment)


class ShmSender:
    """The learner end of `Route.SHM`: generators whose GetStatus names this host's shared memory
    (`shm_host`); its segments live as long as it does."""

    route = Route.SHM

    def __init__(self, timeout_s: float, host: str | None = None):
        self.timeout_s = timeout_s
        self.host = shm_host() if host is None else host
        self._pool = SegmentPool()  # rewritten in place, each once no receiver holds it
        self._lock = threading.Lock()
        self._local: set[str] = set()  # addresses that take this route
        if self.host:
            sweep_stale()  # segments of a pusher that was killed mid-push

    def accepts(self, address: str, status: pb.GetStatusReply) -> bool:
        if self.host and status.shm_host == self.host:
            self._local.add(address)
            return True
        return False

    def forget(self, address: str) -> None:
        self._local.discard(address)

    def begin(self, push: Snapshot, targets: int) -> ShmTransfer:
        """Write `push` into a segment no local receiver holds (`SegmentPool.claim`)."""
        self._lock.acquire()
        try:
            return ShmTransfer(self, ShmPublication(push, self._pool.claim(layout(push.tensors)[1])))
        except BaseException:
            self._lock.release()
            raise

    def done(self, segment: ShmSegment) -> None:
        try:
            self._pool.trim(segment, receivers=len(self._local))
        finally:
            self._lock.release()

    def close(self) -> None:
        with self._lock:
            self._pool.close()  # no segment outlives its pusher

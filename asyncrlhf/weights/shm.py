"""The same-host data plane: a push's bytes through a shared-memory segment, written once per version.

When a receiver sees the pusher's shared memory (`shm_host()` equal on both sides: the same boot and the same
/dev/shm mount), gRPC carries only the control of a push — one WeightChunk per tensor with its name, dtype,
shape, checksum and place in the segment (`shm_segment`, `shm_offset`), then the commit — and the bytes go
through a file in /dev/shm that the pusher writes once per version for all its local receivers:

    pusher                                           each local receiver
    ShmPublication(tensors, segment): write tensor   SegmentReader.resolve: map the segment read-only and
      i, then release its control message -- gRPC -->   hand (header, view of the tensor's bytes) to the
    finish(), after every local push ends               usual staging (copy + XXH3 verify), swap on commit

The receiver copies out of the segment into its staging buffers and verifies each checksum there, so the
guarantees are those of the byte stream: staged, verified, atomic swap; a rejected push leaves the old version
serving; nothing is unpickled. The pusher keeps its segment (`ShmSegment`) for the next version and removes
it when it closes; a pusher killed before that leaves a file named after its pid, which `sweep_stale` (run by
every new pusher: the restarted learner) removes once that pid is gone.

A GPU backend slots in at the same two points (docs/weights.md): a publication whose control messages name
a CUDA IPC handle (or an NCCL broadcast round) instead of a file, and a reader that resolves them to device
memory; the receiver's verification and swap stay as they are.
"""

from __future__ import annotations

import fcntl
import mmap
import os
import re
import secrets
import threading
from collections.abc import Iterable, Iterator, Sequence
from pathlib import Path
from typing import Any

import numpy as np
import xxhash

from asyncrlhf._proto import weights_pb2 as pb
from asyncrlhf.weights.codec import FROM_WIRE, WireTensor, copy_hashed

SHM_DIR = Path("/dev/shm")
PREFIX = "asyncrlhf-w-"
_NAME = re.compile(rf"^{PREFIX}(\d+)-[0-9a-f]+$")  # asyncrlhf-w-<pid>-<random>
_ALIGN = 64
_POPULATE = getattr(mmap, "MAP_POPULATE", 0)  # map the written pages at once, not one fault each


def shm_host() -> str:
    """Who shares this process's /dev/shm: the boot id and the mount's device; "" where there is none."""
    try:
        boot = Path("/proc/sys/kernel/random/boot_id").read_text().strip()
        st = SHM_DIR.stat()
    except OSError:
        return ""
    if not os.access(SHM_DIR, os.W_OK):
        return ""
    return f"{boot}:{st.st_dev}"


def sweep_stale(directory: Path = SHM_DIR) -> list[str]:
    """Remove the segments of pushers that died (SIGKILL, OOM) before closing them; the names removed.

    A live pusher holds an exclusive `flock` on its segment for as long as it has it (`ShmSegment`), and the
    kernel drops the lock when the process dies, however it dies. So a segment whose lock can be taken is
    an orphan. The lock, not the pid in the name, decides: /dev/shm is shared across PID namespaces
    (containers with `ipc: host` or a mounted /dev/shm), where a pid means nothing to this process. A
    segment this process may not open or remove (another user's) is left as it is."""
    removed = []
    for path in directory.glob(f"{PREFIX}*") if directory.is_dir() else ():
        if _NAME.match(path.name) and _orphan(path):
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


def layout(tensors: Sequence[WireTensor]) -> tuple[list[int], int]:
    """Each tensor's offset in a segment (64-byte aligned) and the segment size they need."""
    offsets, size = [], 0
    for t in tensors:
        offsets.append(size)
        size += -(-t.data.nbytes // _ALIGN) * _ALIGN
    return offsets, max(size, 1)


class ShmSegment:
    """A file in /dev/shm (mode 0600) mapped read-write: the pusher's, rewritten in place version after
    version (a fresh tmpfs file costs about five memcpys in page allocation; a rewrite costs one). `close`
    removes it; a pusher killed before that leaves it to `sweep_stale`."""

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

    def close(self) -> None:
        self.path.unlink(missing_ok=True)
        if self._lock_fd >= 0:
            os.close(self._lock_fd)
            self._lock_fd = -1
        try:
            self.map.close()
        except BufferError:  # a view is still alive somewhere; the mapping goes with it
            pass


class ShmPublication:
    """One version's tensors written into `segment` tensor by tensor by a background thread, each hashed
    (XXH3-64) as written, from the segment, while in cache; `control(i)` (blocking until tensor i is written)
    is the message that hands it to a receiver. `finish` once every local push of the version has ended,
    before the segment is rewritten or closed. A receiver still reading when the next version overwrites
    the segment gets a checksum mismatch and keeps its version: reuse is safe."""

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
                self._written[i].set()
            del whole
        except BaseException as err:  # handed to every sender, raised there
            self._error = err
            for event in self._written:
                event.set()

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


def _nbytes(header: pb.WeightChunk) -> int:
    dtype = FROM_WIRE.get(header.dtype)
    itemsize = dtype.itemsize if dtype is not None else 0
    count = 1
    for d in header.shape:
        count *= d
    return count * itemsize


class SegmentReader:
    """The receiver's side: maps the segments a push names (read-only) and resolves each shared-memory
    control message to a view of its tensor's bytes. Use as a context manager around one push."""

    def __init__(self, directory: Path = SHM_DIR):
        self.directory = directory
        self._maps: dict[str, memoryview] = {}
        self._mmaps: list[mmap.mmap] = []

    def resolve(self, messages: Iterable[tuple[pb.WeightChunk, memoryview]]
                ) -> Iterator[tuple[pb.WeightChunk, memoryview]]:
        """Pass byte-stream messages through; give a shared-memory one its bytes from the segment."""
        for header, data in messages:
            if header.shm_segment:
                yield header, self._view(header)
            else:
                yield header, data

    def _view(self, header: pb.WeightChunk) -> memoryview:
        from asyncrlhf.weights.receiver import PushRejected  # the receiver imports this module

        segment = self._maps.get(header.shm_segment)
        if segment is None:
            segment = self._maps[header.shm_segment] = self._open(header.shm_segment)
        start, n = header.shm_offset, _nbytes(header)
        if header.offset != 0 or len(header.data) or start + n > len(segment):
            raise PushRejected("bad_offset", f"`{header.name}`: bytes {start}..{start + n} are not within "
                                             f"segment {header.shm_segment} ({len(segment)} bytes)")
        return segment[start:start + n]

    def _open(self, name: str) -> memoryview:
        from asyncrlhf.weights.receiver import PushRejected

        if not _NAME.match(name):
            raise PushRejected("shm_unavailable", f"`{name}` is not a WeightSync segment name")
        try:
            fd = os.open(self.directory / name, os.O_RDONLY)
        except OSError as err:
            raise PushRejected("shm_unavailable", f"cannot open shared-memory segment {name}: {err}; "
                                                  "the pusher falls back to the byte stream") from err
        try:
            size = os.fstat(fd).st_size
            mapped = mmap.mmap(fd, size, prot=mmap.PROT_READ, flags=mmap.MAP_SHARED | _POPULATE)
        finally:
            os.close(fd)
        self._mmaps.append(mapped)
        return memoryview(mapped)

    def __enter__(self) -> SegmentReader:
        return self

    def __exit__(self, *exc: object) -> None:
        self._maps.clear()
        for mapped in self._mmaps:
            try:
                mapped.close()
            except BufferError:  # a slice is still referenced; the mapping goes with it
                pass
        self._mmaps.clear()

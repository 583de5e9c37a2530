"""The shared-memory route (`Route.SHM`), generator end (`shm.py` has the learner's and the design), and the
route's registration: the segments a push names, opened, locked tensor by tensor and seen through mappings
kept across pushes, their bytes lent to the receiver to verify and adopt in place.
"""

from __future__ import annotations

import fcntl
import mmap
import os
import weakref
from collections.abc import Iterable
from pathlib import Path

from asyncrlhf._proto import weights_pb2 as pb
from asyncrlhf.weights.codec import nbytes_of
from asyncrlhf.weights.routes import Fallback, InPlaceBytes, RouteSpec, SenderSettings, register
from asyncrlhf.weights.shm import SEGMENT_NAME, SHM_DIR, ShmSender, range_lock, shm_host
from asyncrlhf.weights.vocabulary import PushRejected, Reason, Route

_PAGE = mmap.PAGESIZE
_POPULATE_READ = getattr(mmap, "MADV_POPULATE_READ", 22)  # Linux >= 5.14: map a range's pages in one call


class SegmentMaps:
    """A receiver's private mappings of the segments it has read, kept across pushes: the pusher rewrites the
    same two segments version after version, and mapping a segment in costs about as much as hashing it
    (docs/weights.md), so a mapping made once serves every later version written there.

    A private mapping shows the file's current bytes on every page this process has not written; a page a
    live view wrote into (`swap_in` copying into an adopted tensor) keeps the receiver's copy, so a version
    read through a reused mapping that fails its checksum is read again through a fresh one (`fresh`). Each
    mapping is made from an open file description of its own that is never locked: a mapping keeps its
    description open, so a lock taken on it would outlive the lease (`SegmentLease`). A mapping whose file was
    removed (the pusher trimmed or closed the segment) is dropped at the end of a push once no lease holds it
(`prune`)."""

    def __init__(self, directory: Path = SHM_DIR):
        self.directory = directory
        self._maps: dict[str, tuple[int, mmap.mmap]] = {}  # name -> (inode, mapping)
        self.leases: weakref.WeakSet[SegmentLease] = weakref.WeakSet()  # those not yet released

    def mapping(self, name: str, fd: int) -> tuple[mmap.mmap, bool]:
        """The mapping of the file open at `fd` (named `name`) and whether it was reused."""
        ino = os.fstat(fd).st_ino
        cached = self._maps.get(name)
        if cached is not None and cached[0] == ino:
            return cached[1], True
        return self.fresh(name, fd), False

    def fresh(self, name: str, fd: int) -> mmap.mmap:
        """A new private mapping of the file open at `fd`, replacing any kept for `name`."""
        st = os.fstat(fd)
        own = os.open(self.directory / name, os.O_RDONLY)
        try:
            if os.fstat(own).st_ino != st.st_ino:
                raise FileNotFoundError(f"segment {name} was replaced while it was being opened")
            # private and writable: a write into a live view copies the page, never reaches the segment
            mapping = mmap.mmap(own, st.st_size, flags=mmap.MAP_PRIVATE,
                                prot=mmap.PROT_READ | mmap.PROT_WRITE)
        finally:
            os.close(own)
        self._drop(name)
        self._maps[name] = (st.st_ino, mapping)
        return mapping

    def prune(self, in_use: Iterable[str] = ()) -> None:
        """Drop the mappings of segments not `in_use`, nor held by a lease, whose file is gone or replaced."""
        used = {*in_use, *(lease.name for lease in self.leases)}
        for name, (ino, _) in list(self._maps.items()):
            if name in used:
                continue
            try:
                alive = (self.directory / name).stat().st_ino == ino
            except OSError:
                alive = False
            if not alive:
                self._drop(name)

    def names(self) -> list[str]:
        return list(self._maps)

    def _drop(self, name: str) -> None:
        cached = self._maps.pop(name, None)
        if cached is not None:
            try:
                cached[1].close()
            except BufferError:  # a tensor still views it; the mapping goes with the last one
                pass

    def close(self) -> None:
        for name in list(self._maps):
            self._drop(name)


class SegmentLease:
    """A receiver's hold on one segment for one version: a read lock on the bytes of each tensor it takes
    from it (`take`), which the pusher cannot claim past, and views of them through the receiver's mapping
    (`SegmentMaps`). Held for one push, and past it for as long as live tensors are views of those bytes;
    `release` drops every lock (closing the lease's own file does: no mapping was made from it)."""

    def __init__(self, name: str, fd: int, maps: SegmentMaps):
        self.name, self._fd, self._maps = name, fd, maps
        self._mapping, self.reused = maps.mapping(name, fd)  # reused: a failed checksum is read again
        self._mapped_in = self.reused
        self.view = memoryview(self._mapping)
        self._close = weakref.finalize(self, os.close, fd)  # a lease dropped unreleased closes its file
        self.kept = False  # held past the push it was opened for
        maps.leases.add(self)

    def refreshed(self, start: int, n: int) -> memoryview:
        """Bytes [start, start + n) through a fresh mapping (the reused one's pages may hold our own
        writes), which later `take`s use too."""
        self._mapping, self._mapped_in = self._maps.fresh(self.name, self._fd), False
        self.view = memoryview(self._mapping)
        self.populate(start, n)
        return self.view[start:start + n]

    def take(self, header: pb.WeightChunk) -> memoryview:
        """Lock the bytes `header` names and return a view of them (mapped in, not yet read)."""

        start, n = header.shm_offset, nbytes_of(header)
        if header.offset != 0 or len(header.data) or start + n > len(self.view):
            raise PushRejected(Reason.BAD_OFFSET, f"`{header.name}`: bytes {start}..{start + n} are not "
                                                  f"within segment {self.name} ({len(self.view)} bytes)")
        if n and not range_lock(self._fd, fcntl.F_RDLCK, start, n):
            raise PushRejected(Reason.STALE_VERSION, f"`{header.name}`: segment {self.name} is being "
                                                     "rewritten with a newer version")
        return self.view[start:start + n]

    def populate(self, start: int, n: int) -> None:
        """Map the pages of bytes [start, start + n) of a fresh mapping in one call (a fault per page
        otherwise); a reused mapping has them mapped already."""
        if n and not self._mapped_in:
            first = start - start % _PAGE
            try:
                self._mapping.madvise(_POPULATE_READ, first, start + n - first)
            except OSError:  # an older kernel: the pages fault in as they are read
                pass

    def keep(self) -> None:
        self.kept = True

    def release(self) -> None:
        self._close()  # closing the file drops every lock of this lease; the mapping stays with `maps`
        self._maps.leases.discard(self)


class ShmSource:
    """The generator end of `Route.SHM` for one push: opens the segments its messages name (leases) and
    lends each tensor's locked bytes. Use as a context manager around the push; on exit, every lease not
    kept (`SegmentLease.keep`) is released. `maps`: the receiver's mappings, kept across pushes."""

    route = Route.SHM

    def __init__(self, maps: SegmentMaps | None = None):
        self.maps = maps if maps is not None else SegmentMaps()
        self.directory = self.maps.directory
        self.leases: dict[str, SegmentLease] = {}

    def payload(self, header: pb.WeightChunk, inline: memoryview) -> InPlaceBytes:
        lease = self.leases.get(header.shm_segment)
        if lease is None:
            lease = self.leases[header.shm_segment] = self._open(header.shm_segment)
        return InPlaceBytes(lease.take(header), header.shm_offset, lease)

    def _open(self, name: str) -> SegmentLease:
        if not SEGMENT_NAME.match(name):
            raise PushRejected(Reason.SHM_UNAVAILABLE, f"`{name}` is not a WeightSync segment name")
        try:
            fd = os.open(self.directory / name, os.O_RDONLY)
        except OSError as err:
            raise PushRejected(Reason.SHM_UNAVAILABLE, f"cannot open shared-memory segment {name}: {err}; "
                                                       "the pusher falls back to the byte stream") from err
        try:
            return SegmentLease(name, fd, self.maps)
        except BaseException as err:
            os.close(fd)
            if isinstance(err, OSError):
                raise PushRejected(Reason.SHM_UNAVAILABLE, f"cannot map shared-memory segment {name}: "
                                                           f"{err}; the pusher falls back to the byte stream"
                                   ) from err
            raise

    def __enter__(self) -> ShmSource:
        return self

    def __exit__(self, *exc: object) -> None:
        for lease in self.leases.values():
            if not lease.kept:
                lease.release()
        self.leases.clear()
        self.maps.prune()


def _sender(settings: SenderSettings) -> ShmSender | None:
    return ShmSender(settings.timeout_s) if shm_host() else None


def _offer(maps: SegmentMaps, status: pb.GetStatusReply) -> None:
    status.shm_host = shm_host()


# The segment holds one version a round (`one_transfer`): when one same-host target needs the version whole,
# every same-host target gets it whole.
register(RouteSpec(Route.SHM, _sender, lambda header: bool(header.shm_segment), ShmSource, preference=20,
                   standing=SegmentMaps, offer=_offer, one_transfer=True,
                   fallbacks={Reason.SHM_UNAVAILABLE: Fallback(avoid=True)}))

"""The shared-memory hop: verified tensors handed to another process on this host through shared memory,
with no file per version: how a generator gives a pushed version (or an unmerged LoRA adapter) to the workers
of a vLLM engine that runs in processes of its own (`generator.vllm.handoff: shm`, or `auto` where /dev/shm
is writable).

- `Handoff` (the generator's end): one segment in /dev/shm (a `shm.ShmSegment`: mode 0600, flock-held while
  the generator lives, swept by the next pusher if it dies), rewritten version after version; a new one only
  when a version needs more bytes than it has. `write` copies each tensor in, hashing it as written
  (`codec.copy_hashed`: the checksum is of the bytes stored, not of their source), and returns a `Manifest`
  of plain values (segment name; per tensor: name, dtype, shape, offset, byte count, XXH3-64), which crosses
  vLLM's `collective_rpc` as msgpack.
- `SharedMemory`: the hop (`hop.EngineHop`) around a `Handoff`: it writes, then has the workers load.
- `read` (the worker's end): maps the segment (a private mapping kept across versions, `shm_read.SegmentMaps`:
  mapping pages in costs about as much as hashing them), checks every tensor's XXH3-64 against the manifest,
  and only then returns the tensors (views of the mapping): a worker loads verified bytes or nothing.

No lock is needed between the ends: the generator writes only while it holds its backend (the receiver
applies one push at a time, under the gate no generation runs through) and the worker reads inside the
synchronous `collective_rpc` of that same apply. A version that fails its check raises `HandoffMismatch` in
the worker before anything is loaded: the engine keeps serving the old version.
"""

from __future__ import annotations

import os
from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import Any, TypedDict

import numpy as np
import torch
import xxhash

from asyncrlhf.sampling.hops.hop import Adapter, HopKind, land
from asyncrlhf.weights.codec import copy_hashed
from asyncrlhf.weights.collective_member import Member
from asyncrlhf.weights.shm import SEGMENT_NAME, SHM_DIR, ShmSegment, shm_host
from asyncrlhf.weights.shm_read import SegmentMaps


class Manifest(TypedDict):
    """Where a version lies: its segment, and per tensor [name, dtype name, shape, offset, nbytes, xxh3]."""

    segment: str
    tensors: list[list[Any]]


class HandoffMismatch(RuntimeError):
    """The worker read bytes other than the generator wrote (or no such segment): nothing was loaded."""


def available(directory: Path = SHM_DIR) -> bool:
    """Whether this host has a shared memory a handoff can use (a writable /dev/shm with OFD locks)."""
    return directory != SHM_DIR or bool(shm_host())


def aligned(sizes: Iterable[int], align: int = 64) -> tuple[list[int], int]:
    """Each of `sizes` bytes at an `align`-byte boundary: their offsets and the bytes they need in all."""
    offsets, end = [], 0
    for size in sizes:
        offsets.append(end)
        end += -(-size // align) * align
    return offsets, max(end, 1)


def _dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


class Handoff:
    """The generator's end: one segment, rewritten per version (`write`); `close` removes it."""

    def __init__(self, directory: Path = SHM_DIR):
        self.directory = directory
        self.segment: ShmSegment | None = None

    def write(self, tensors: Mapping[str, torch.Tensor]) -> Manifest:
        """Copy `tensors` (CPU) into the segment, each hashed as written; the manifest a reader needs."""
        flat = {name: t.detach().contiguous() for name, t in tensors.items()}
        views = [memoryview(t.reshape(-1).view(torch.uint8).numpy())  # type: ignore[arg-type]
                 for t in flat.values()]
        offsets, size = aligned(view.nbytes for view in views)
        segment = self._segment(size)
        whole = np.frombuffer(segment.map, dtype=np.uint8)
        entries = []
        for (name, t), view, offset in zip(flat.items(), views, offsets, strict=True):
            digest = xxhash.xxh3_64()
            copy_hashed(whole[offset:offset + view.nbytes], view, digest)
            entries.append([name, _dtype_name(t.dtype), list(t.shape), offset, view.nbytes,
                            digest.intdigest()])
        del whole
        return Manifest(segment=segment.name, tensors=entries)

    def _segment(self, size: int) -> ShmSegment:
        if self.segment is not None and self.segment.size >= size:
            return self.segment
        self.close()
        self.segment = ShmSegment(size, self.directory)
        return self.segment

    def close(self) -> None:
        if self.segment is not None:
            self.segment.close()
            self.segment = None


class SharedMemory:
    """The hop: the version written into `handoff`'s segment, read back and checked by every worker."""

    kind = HopKind.SHM

    def __init__(self, handoff: Handoff | None = None):
        self.handoff = handoff or Handoff()

    @property
    def rounds(self) -> Member | None:
        return None

    def load(self, llm: Any, tensors: Mapping[str, torch.Tensor], adapter: Adapter | None = None) -> None:
        land(llm, self.kind, self.handoff.write(tensors), adapter)

    def close(self) -> None:
        self.handoff.close()


def read(manifest: Manifest, maps: SegmentMaps) -> dict[str, torch.Tensor]:
    """The verified tensors of `manifest` (views of the segment through `maps`, kept by the caller across
    versions); `HandoffMismatch` if the segment is gone or any tensor's bytes fail their checksum."""
    name = manifest["segment"]
    if not SEGMENT_NAME.match(name):
        raise HandoffMismatch(f"`{name}` is not a WeightSync segment name")
    try:
        fd = os.open(maps.directory / name, os.O_RDONLY)
    except OSError as err:
        raise HandoffMismatch(f"cannot open the handoff segment {name}: {err}") from err
    try:
        mapping, reused = maps.mapping(name, fd)
        whole = memoryview(mapping)
        out: dict[str, torch.Tensor] = {}
        for tensor_name, dtype, shape, offset, nbytes, checksum in manifest["tensors"]:
            data = whole[offset:offset + nbytes]
            if reused and not _matches(data, nbytes, checksum):  # a page of the kept mapping may be ours
                whole, reused = memoryview(maps.fresh(name, fd)), False
                data = whole[offset:offset + nbytes]
            if not _matches(data, nbytes, checksum):
                raise HandoffMismatch(f"`{tensor_name}`: the bytes in segment {name} are not those the "
                                      "generator verified; nothing was loaded")
            out[tensor_name] = _tensor(data, dtype, shape)
    finally:
        os.close(fd)
    maps.prune([name])  # the mapping of a segment the generator outgrew and removed
    return out


def _matches(data: memoryview, nbytes: int, checksum: int) -> bool:
    return len(data) == nbytes and xxhash.xxh3_64_intdigest(data) == checksum


def _tensor(data: memoryview, dtype: str, shape: list[int]) -> torch.Tensor:
    flat = torch.frombuffer(data, dtype=torch.uint8) if len(data) else torch.empty(0, dtype=torch.uint8)
    return flat.view(getattr(torch, dtype)).reshape(shape)

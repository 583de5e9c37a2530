"""The collective route's floor for `asyncrlhf bench transport`: a bare gloo broadcast of the same bytes, in
buckets of the same size, two in flight as the route sends them, from this process to a child, host buffers
on both ends, nothing packed, hashed or verified."""

from __future__ import annotations

import datetime
import multiprocessing
import statistics
import time

import torch
from torch.distributed import PrefixStore, TCPStore

from asyncrlhf.weights.collective import GLOO, IN_FLIGHT, broadcast, process_group

TIMEOUT_S = 600.0


def _broadcast_all(group, total: int, bucket_bytes: int) -> float:
    """Seconds to broadcast `total` bytes in buckets (rank 0 sends, rank 1 receives)."""
    ring = [torch.ones(bucket_bytes, dtype=torch.uint8) for _ in range(IN_FLIGHT)]
    works: list = []
    start = time.perf_counter()
    for k, offset in enumerate(range(0, total, bucket_bytes)):
        if len(works) == IN_FLIGHT:
            works.pop(0).wait()
        works.append(broadcast(group, ring[k % IN_FLIGHT][:min(bucket_bytes, total - offset)]))
    for work in works:
        work.wait()
    return time.perf_counter() - start


def _receiver(port: int, total: int, bucket_bytes: int, repeats: int) -> None:
    store = TCPStore("127.0.0.1", port, is_master=False, wait_for_workers=False,
                     timeout=datetime.timedelta(seconds=TIMEOUT_S))
    group = process_group(GLOO, PrefixStore("bare", store), 1, 2, TIMEOUT_S)
    for _ in range(repeats):
        _broadcast_all(group, total, bucket_bytes)


def bare_gloo_gbps(total: int, bucket_bytes: int, repeats: int) -> float:
    """GB/s of `repeats` bare broadcasts of `total` bytes to a child process (the median, not the first)."""
    store = TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False,
                     timeout=datetime.timedelta(seconds=TIMEOUT_S))
    child = multiprocessing.get_context("spawn").Process(
        target=_receiver, args=(store.port, total, bucket_bytes, repeats), daemon=True)
    child.start()
    try:
        group = process_group(GLOO, PrefixStore("bare", store), 0, 2, TIMEOUT_S)
        seconds = [_broadcast_all(group, total, bucket_bytes) for _ in range(repeats)]
    finally:
        child.join(60)
        if child.is_alive():
            child.kill()
    return total / statistics.median(seconds[1:]) / 1e9

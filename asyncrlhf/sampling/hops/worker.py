"""The hops' worker halves, in each vLLM worker (`vllm_engine.WeightLoaderExtension` holds one `WorkerEnd`):
what a hop's message names, read back as verified tensors, or an error before any is returned."""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

import torch

from asyncrlhf.sampling.hops.engine_member import WorkerRounds
from asyncrlhf.sampling.hops.file import read as read_file
from asyncrlhf.sampling.hops.hop import HopKind
from asyncrlhf.sampling.hops.shared_memory import read as read_shared
from asyncrlhf.weights.shm_read import SegmentMaps
from asyncrlhf.weights.vocabulary import PushRejected, Reason


class WorkerEnd:
    """One worker's halves of every hop, and what they keep across versions: the mappings of the handoff's
    segment (mapping pages in costs about as much as hashing them) and the collective rounds it takes."""

    def __init__(self) -> None:
        self.maps = SegmentMaps()
        self.rounds: WorkerRounds | None = None

    def join(self, device: str, authkey: bytes) -> WorkerRounds:
        """Take the collective route's rounds here (`engine_member.WorkerRounds`); asked again, anew."""
        if self.rounds is not None:
            self.rounds.close()
        self.rounds = WorkerRounds(device, authkey)
        return self.rounds

    def received(self, kind: str, message: Any) -> Mapping[str, torch.Tensor]:
        """The verified tensors `message` names by hop `kind` (raises `PushRejected` or the hop's own error
        before returning any)."""
        return _HALVES[HopKind(kind)](self, message)

    def taken(self, held: tuple[bytes, int, list[Any]]) -> dict[str, torch.Tensor]:
        """The worker round's half: the tensors of the round `held` names (`EngineMember.held`: its places
        arrive as lists, off the RPC), once each checks."""
        if self.rounds is None:
            raise PushRejected(Reason.COLLECTIVE_UNAVAILABLE,
                               "this worker takes no rounds: the generator did not ask it to join them")
        group, round_id, places = held
        return self.rounds.take(group, round_id, [tuple(p) for p in places])


_HALVES: dict[HopKind, Callable[[WorkerEnd, Any], Mapping[str, torch.Tensor]]] = {
    HopKind.IN_PROCESS: lambda _end, tensors: tensors,
    HopKind.SHM: lambda end, manifest: read_shared(manifest, end.maps),
    HopKind.FILE: lambda _end, path: read_file(path),
    HopKind.WORKER_ROUND: WorkerEnd.taken,
}

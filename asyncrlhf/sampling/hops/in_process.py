"""The in-process hop: the engine's core and its one worker run in the generator's process (the default on
CPU), so a push hands the worker the verified tensors themselves; no copy, no segment, no file."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch

from asyncrlhf.sampling.hops.hop import Adapter, HopKind, land
from asyncrlhf.weights.collective_member import Member


class InProcess:
    """The generator's half; the worker's takes the tensors as they come (`worker.WorkerEnd`)."""

    kind = HopKind.IN_PROCESS

    @property
    def rounds(self) -> Member | None:
        return None

    def load(self, llm: Any, tensors: Mapping[str, torch.Tensor], adapter: Adapter | None = None) -> None:
        land(llm, self.kind, dict(tensors), adapter)

    def close(self) -> None:
        """Nothing held."""

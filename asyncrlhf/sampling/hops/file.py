"""The file hop: a safetensors file per version in the generator's work directory, for an engine in
processes of its own on a host with no usable /dev/shm (`generator.vllm.handoff: file`). The file is
removed once the workers have loaded it (or refused it): none outlives its push."""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path
from typing import Any

import torch

from asyncrlhf.sampling.hops.hop import Adapter, HopKind, land
from asyncrlhf.weights.collective_member import Member

PUSH_FILE = "push.safetensors"


class File:
    """The generator's half: writes `work_dir/push.safetensors`; the workers read it (`read`); it goes."""

    kind = HopKind.FILE

    def __init__(self, work_dir: Path):
        self.path = work_dir / PUSH_FILE

    @property
    def rounds(self) -> Member | None:
        return None

    def load(self, llm: Any, tensors: Mapping[str, torch.Tensor], adapter: Adapter | None = None) -> None:
        try:
            land(llm, self.kind, self.write(tensors), adapter)
        finally:
            self.path.unlink(missing_ok=True)

    def write(self, tensors: Mapping[str, torch.Tensor]) -> str:
        """The push file of `tensors`: its path, what crosses the RPC."""
        from safetensors.torch import save_file

        save_file({name: t.contiguous() for name, t in tensors.items()}, str(self.path))
        return str(self.path)

    def close(self) -> None:
        self.path.unlink(missing_ok=True)


def read(path: str) -> dict[str, torch.Tensor]:
    """The worker's half: the tensors of the push file (safetensors checks its own header and sizes)."""
    from safetensors.torch import load_file

    return load_file(path)

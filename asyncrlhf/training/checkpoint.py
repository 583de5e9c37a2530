"""Learner checkpoints: HF-format weights (full, or the LoRA adapter), DeepSpeed state, learner state and the
resolved config, written to `<run dir>/checkpoints/step-<version>/` and published by an atomic `latest` file.
"""

from __future__ import annotations

import json
import os
import shutil
from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch

from asyncrlhf.config import Config

LATEST = "latest"


@dataclass
class LearnerState:
    version: int = 1  # policy version = optimizer steps + 1 (0 means "no weights" to a generator)
    cursor: int = 0  # groups enqueued when the checkpoint was taken (Redis holds the live value)
    finished: int = 0  # groups trained, dropped or dead-lettered
    rng: list[int] = field(default_factory=list)
    kl_coef: float | None = None

    @property
    def steps(self) -> int:
        return self.version - 1


def checkpoints_dir(cfg: Config) -> Path:
    return cfg.run.path / "checkpoints"


def latest_checkpoint(cfg: Config) -> Path | None:
    pointer = checkpoints_dir(cfg) / LATEST
    if not pointer.is_file():
        return None
    path = checkpoints_dir(cfg) / pointer.read_text().strip()
    return path if (path / "learner_state.json").is_file() else None


def save(cfg: Config, policy, value, tokenizer, state: LearnerState, hf_state: dict[str, torch.Tensor] | None,
         rank: int) -> Path:
    """Every rank writes its DeepSpeed shard; rank 0 writes the rest and then flips `latest`."""
    root = checkpoints_dir(cfg)
    name = f"step-{state.version:06d}"
    path = root / name
    policy.save_checkpoint(str(path / "deepspeed"), tag="policy")
    if value is not None:
        value.save_checkpoint(str(path / "deepspeed"), tag="value")
    if rank != 0:
        return path
    hf_dir = path / "hf"
    policy.module.save_pretrained(hf_dir, state_dict=hf_state, safe_serialization=True)
    tokenizer.save_pretrained(hf_dir)
    state.rng = torch.get_rng_state().tolist()
    (path / "learner_state.json").write_text(json.dumps(asdict(state)))
    (path / "config.yaml").write_text(cfg.to_yaml())
    tmp = root / f".{LATEST}.tmp"
    tmp.write_text(name)
    os.replace(tmp, root / LATEST)
    _prune(root, keep=cfg.learner.keep_checkpoints)
    return path


def load(path: Path, policy, value) -> LearnerState:
    policy.load_checkpoint(str(path / "deepspeed"), tag="policy", load_module_strict=False)
    if value is not None:
        value.load_checkpoint(str(path / "deepspeed"), tag="value")
    state = LearnerState(**json.loads((path / "learner_state.json").read_text()))
    if state.rng:
        torch.set_rng_state(torch.tensor(state.rng, dtype=torch.uint8))
    return state


def _prune(root: Path, keep: int) -> None:
    steps = sorted(p for p in root.glob("step-*") if p.is_dir())
    for old in steps[:-keep]:
        shutil.rmtree(old, ignore_errors=True)

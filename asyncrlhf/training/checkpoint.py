"""Learner checkpoints, and the one module that knows their layout:

    <run dir>/checkpoints/
        latest                  the name of the newest complete checkpoint (replaced atomically)
        step-<version:06d>/
            hf/                 HF-format weights (full, or the LoRA adapter) and the tokenizer
            deepspeed/          DeepSpeed state of every rank (tags `policy`, `value`)
            learner_state.json  `LearnerState`: version, lineage, feed cursor, finished count, RNG
            config.yaml         the resolved config

The learner saves and loads them; the evaluator, the launcher, the offline stages and the benchmarks find
and read them through the functions below. Finding and reading them imports neither torch nor the models (the
launcher reads the last version at the end of every run): the functions that load weights import them.
"""

from __future__ import annotations

import json
import os
import shutil
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING

import yaml

from asyncrlhf.config import Config, ModelConfig
from asyncrlhf.model_sources import ModelLoadError

if TYPE_CHECKING:
    import torch
    from torch import nn

CHECKPOINTS = "checkpoints"
LATEST = "latest"
HF = "hf"
DEEPSPEED = "deepspeed"
STATE = "learner_state.json"
CONFIG = "config.yaml"


@dataclass
class LearnerState:
    version: int = 1  # policy version = optimizer steps + 1 (0 means "no weights" to a generator)
    cursor: int = 0  # groups enqueued when the checkpoint was taken (Redis holds the live value)
    finished: int = 0  # groups trained, dropped or dead-lettered
    rng: list[int] = field(default_factory=list)
    kl_coef: float | None = None
    lineage: int = 0  # the learner lineage that wrote the checkpoint (see asyncrlhf.consumed)

    @property
    def steps(self) -> int:
        return self.version - 1


def checkpoints_dir(run_dir: Path) -> Path:
    return run_dir / CHECKPOINTS


def step_dir(run_dir: Path, version: int) -> Path:
    """Where the checkpoint of policy `version` lives."""
    return checkpoints_dir(run_dir) / f"step-{version:06d}"


def step_dirs(run_dir: Path) -> list[Path]:
    """The run's checkpoint directories, oldest first."""
    return sorted(p for p in checkpoints_dir(run_dir).glob("step-*") if p.is_dir())


def latest_checkpoint(cfg: Config) -> Path | None:
    """The newest complete checkpoint of `cfg`'s run, or None."""
    pointer = checkpoints_dir(cfg.run.path) / LATEST
    if not pointer.is_file():
        return None
    path = checkpoints_dir(cfg.run.path) / pointer.read_text().strip()
    return path if (path / STATE).is_file() else None


def latest_version(cfg: Config) -> int | None:
    """The policy version of the newest complete checkpoint, or None when there is none."""
    latest = latest_checkpoint(cfg)
    return read_state(latest).version if latest is not None else None


def read_state(path: Path) -> LearnerState:
    """The `LearnerState` a checkpoint recorded."""
    return LearnerState(**json.loads((path / STATE).read_text()))


def saved_config(path: Path) -> dict | None:
    """The resolved config a checkpoint was trained with, as `Config.to_yaml` wrote it (a plain mapping: a
    config of another version of this code still reads); None when the checkpoint has none."""
    file = path / CONFIG
    return yaml.safe_load(file.read_text()) if file.is_file() else None


def write_state(path: Path, state: LearnerState) -> None:
    (path / STATE).write_text(json.dumps(asdict(state)))


def publish(path: Path) -> None:
    """Point `latest` at the checkpoint `path`, atomically (readers never see a half-written pointer)."""
    tmp = path.parent / f".{LATEST}.tmp"
    tmp.write_text(path.name)
    os.replace(tmp, path.parent / LATEST)


def save(cfg: Config, policy, value, tokenizer, state: LearnerState, hf_state: dict[str, torch.Tensor] | None,
         rank: int) -> Path:
    """Every rank writes its DeepSpeed shard; rank 0 writes the rest and then flips `latest`."""
    path = step_dir(cfg.run.path, state.version)
    policy.save_checkpoint(str(path / DEEPSPEED), tag="policy")
    if value is not None:
        value.save_checkpoint(str(path / DEEPSPEED), tag="value")
    if rank != 0:
        return path
    policy.module.save_pretrained(path / HF, state_dict=hf_state, safe_serialization=True)
    tokenizer.save_pretrained(path / HF)
    import torch

    state.rng = torch.get_rng_state().tolist()
    write_state(path, state)
    (path / CONFIG).write_text(cfg.to_yaml())
    publish(path)
    _prune(cfg.run.path, keep=cfg.learner.keep_checkpoints)
    return path


def load(path: Path, policy, value) -> LearnerState:
    policy.load_checkpoint(str(path / DEEPSPEED), tag="policy", load_module_strict=False)
    if value is not None:
        value.load_checkpoint(str(path / DEEPSPEED), tag="value")
    state = read_state(path)
    if state.rng:
        import torch

        torch.set_rng_state(torch.tensor(state.rng, dtype=torch.uint8))
    return state


def _prune(run_dir: Path, keep: int) -> None:
    for old in step_dirs(run_dir)[:-keep]:
        shutil.rmtree(old, ignore_errors=True)


# ---------------------------------------------------------------------------------------------------------
# Checkpoints as policies


def hf_dir(path: str | Path) -> Path:
    """The HF directory of a checkpoint: accepts `checkpoints/` (follows `latest`), `step-XXXXXX/`, or the
    `hf/` directory itself (or any HF model directory, e.g. `asyncrlhf sft` output)."""
    path = Path(path).expanduser()
    if (path / LATEST).is_file():
        path = path / (path / LATEST).read_text().strip()
    if (path / HF).is_dir():
        path = path / HF
    if not ((path / "config.json").is_file() or (path / "adapter_config.json").is_file()):
        raise ModelLoadError(
            f"{path} is not a checkpoint: expected `{HF}/` with config.json (full weights) or "
            f"adapter_config.json (LoRA), as the learner writes under <run.dir>/{CHECKPOINTS}/step-XXXXXX/"
        )
    return path


def checkpoint_version(path: str | Path) -> int | None:
    """Policy version recorded in a learner checkpoint (its `LearnerState`), None for a plain HF dir."""
    hf = hf_dir(path)
    if hf.name != HF or not (hf.parent / STATE).is_file():
        return None
    return read_state(hf.parent).version


def load_checkpoint_policy(path: str | Path, base: ModelConfig | str, *, device: str = "cpu") -> nn.Module:
    """A learner checkpoint as a causal LM: full weights, or `base` plus the saved PEFT adapter (LoRA
    runs)."""
    from asyncrlhf.models import as_model_config, load_policy, resolve_device

    hf = hf_dir(path)
    cfg = as_model_config(base)
    policy: nn.Module
    if (hf / "adapter_config.json").is_file():
        from peft import PeftModel

        policy = PeftModel.from_pretrained(load_policy(cfg), hf)
    else:
        policy = load_policy(cfg.model_copy(update={"name_or_path": str(hf), "gguf_file": None}))
    return policy.to(resolve_device(device))

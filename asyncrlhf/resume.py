"""What `asyncrlhf up` does with a run directory that already holds a checkpoint, said before anything
starts: resume from it (and say from which step and checkpoint), refuse when the config changed what the
checkpoint was trained with, or start afresh (`--fresh`: the old directory is moved aside, never deleted).

A checkpoint's weights and optimizer state mean something only for the model, tokenizer, adapter and
algorithm that produced them. `IDENTITY` lists the keys that decide these, each with what it decides; every
other key (learning rate, batch sizes, staleness, sampling, steps) may change between a run and its resume.
The resolved config saved with every checkpoint (`training.checkpoint`) is what the current one is
compared with."""

from __future__ import annotations

import re
import time
from collections.abc import Callable, Collection, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import yaml

from asyncrlhf.config import Config
from asyncrlhf.training import checkpoint

IDENTITY: dict[str, str] = {
    "model.name_or_path": "the weights and tokenizer the checkpoint started from",
    "model.gguf_file": "the weights file the checkpoint started from",
    "model.revision": "the hub commit the checkpoint started from",
    "model.tiny": "the tiny model's shape",
    "learner.algorithm": "the objective, and the models it trains (PPO's value model)",
    "learner.lora.enabled": "whether the checkpoint holds an adapter or full weights",
    "learner.lora.r": "the adapter's shape",
    "learner.lora.alpha": "the adapter's scale",
    "learner.lora.target_modules": "the layers the adapter wraps",
    "learner.deepspeed.zero_stage": "how the saved optimizer state is partitioned",
}
COMMIT = re.compile(r"^[0-9a-f]{40}$")


@dataclass(frozen=True)
class Change:
    key: str
    saved: Any
    now: Any

    def __str__(self) -> str:
        return f"{self.key}: {self.saved!r} -> {self.now!r} ({IDENTITY[self.key]})"


def lookup(tree: Mapping[str, Any], key: str) -> Any:
    """The value at dotted `key` in a nested mapping (None where a level is missing)."""
    node: Any = tree
    for part in key.split("."):
        node = node.get(part) if isinstance(node, Mapping) else None
    return node


def changes(saved: Mapping[str, Any], now: Mapping[str, Any]) -> list[Change]:
    """The `IDENTITY` keys whose value differs between the checkpoint's config and the current one (both
    as `Config.to_yaml` writes them). Keys that decide nothing are left out: the tiny shape unless the model
    is `tiny`, the adapter's settings unless LoRA is on in both. A revision counts only where the current
    one pins a commit: the checkpoint records the commit a branch resolved to, which a branch name or no
    revision cannot be compared with without asking the hub."""
    out = []
    for key in IDENTITY:
        before, after = lookup(saved, key), lookup(now, key)
        if before == after or _decides_nothing(key, saved, now, after):
            continue
        out.append(Change(key, before, after))
    return out


def _decides_nothing(key: str, saved: Mapping[str, Any], now: Mapping[str, Any], after: Any) -> bool:
    if key == "model.tiny":
        return lookup(now, "model.name_or_path") != "tiny"
    if key.startswith("learner.lora.") and key != "learner.lora.enabled":
        return not (lookup(saved, "learner.lora.enabled") and lookup(now, "learner.lora.enabled"))
    if key == "model.revision":
        return not (isinstance(after, str) and COMMIT.match(after))
    return False


@dataclass(frozen=True)
class Found:
    """The checkpoint `up` would resume from."""

    path: Path
    steps: int  # optimizer steps it holds
    changed: list[Change]
    config_saved: bool


def find(cfg: Config) -> Found | None:
    """The run's newest checkpoint and what changed since it was trained; None when there is none."""
    path = checkpoint.latest_checkpoint(cfg)
    if path is None:
        return None
    saved = checkpoint.saved_config(path)
    now = yaml.safe_load(cfg.to_yaml())
    return Found(path, checkpoint.read_state(path).steps, changes(saved or {}, now), saved is not None)


def move_aside(run_dir: Path) -> Path:
    """Rename `run_dir` to a sibling stamped with the time (and a counter if that exists too)."""
    stamp = time.strftime("%Y%m%d-%H%M%S")
    target = run_dir.with_name(f"{run_dir.name}.{stamp}")
    n = 1
    while target.exists():
        target, n = run_dir.with_name(f"{run_dir.name}.{stamp}-{n}"), n + 1
    run_dir.rename(target)
    return target


def prepare_run_dir(cfg: Config, flags: Collection[str], say: Callable[[str], None]) -> str | None:
    """Decide, before anything starts, what `up` does with the run directory (`flags`: `--fresh`,
    `--resume-anyway`), say it, and write the run's config there; returns why it must not start (None: go
    on, and nothing is written otherwise)."""
    refused = _decide(cfg, flags, say)
    if refused is None:
        cfg.run.path.mkdir(parents=True, exist_ok=True)
        (cfg.run.path / "config.yaml").write_text(cfg.to_yaml())
    return refused


def _decide(cfg: Config, flags: Collection[str], say: Callable[[str], None]) -> str | None:
    run_dir, name = cfg.run.path, cfg.run.name
    if {"--fresh", "--resume-anyway"} <= set(flags):
        return "--fresh starts afresh and --resume-anyway resumes: give one of them"
    if "--fresh" in flags:
        return _start_fresh(cfg, say)
    found = find(cfg)
    if found is None:
        return None
    if found.changed and "--resume-anyway" not in flags:
        listed = "\n".join(f"  {c}" for c in found.changed)
        return (f"run `{name}` has a checkpoint at step {found.steps} ({found.path}) trained with another "
                f"config:\n{listed}\nResuming would load it into a different model. Start afresh with "
                f"`--fresh` (the old {run_dir} is moved aside, not deleted), pick another run.name, or "
                "resume anyway with `--resume-anyway`.")
    say(f"resuming run {name} from step {found.steps} (checkpoint {found.path})")
    if found.changed:
        say("--resume-anyway: resuming although " + "; ".join(str(c) for c in found.changed))
    elif not found.config_saved:
        say(f"the checkpoint has no {checkpoint.CONFIG}: the config it was trained with is not checked")
    return None


def _start_fresh(cfg: Config, say: Callable[[str], None]) -> str | None:
    run_dir = cfg.run.path
    if cfg.redis.external:
        return (f"--fresh starts a new run directory, but run `{cfg.run.name}`'s streams live in the Redis "
                f"this config names ({cfg.redis.where}), where a new run would find the old one's: pick "
                "another run.name for a fresh run")
    if not run_dir.exists():
        return None
    moved = move_aside(run_dir)
    say(f"--fresh: moved the earlier run directory {run_dir} to {moved}; run {cfg.run.name} starts afresh")
    return None

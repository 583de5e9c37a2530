"""Learner-format checkpoints of the tiny model, written without a learner (tests only)."""

from __future__ import annotations

import json
from pathlib import Path

import torch

from asyncrlhf.config import LoraConfig
from asyncrlhf.models import load_policy, load_tokenizer, wrap_lora


def write_checkpoint(run_dir: Path, version: int, *, scale: float = 1.5, lora: bool = False) -> Path:
    """`<run_dir>/checkpoints/step-<version>/` as the learner lays it out: hf/ (full model, or the LoRA
    adapter), learner_state.json, and the `latest` pointer; the weights differ from the initial policy's."""
    policy = load_policy("tiny")
    if lora:
        policy = wrap_lora(policy, LoraConfig(enabled=True, r=4, alpha=8))
        with torch.no_grad():
            for name, p in policy.named_parameters():
                if "lora_B" in name:
                    p.fill_(0.05)
    else:
        with torch.no_grad():
            policy.lm_head.weight.mul_(scale)
    root = run_dir / "checkpoints"
    path = root / f"step-{version:06d}"
    policy.save_pretrained(path / "hf", safe_serialization=True)
    load_tokenizer("tiny").save_pretrained(path / "hf")
    (path / "learner_state.json").write_text(json.dumps({"version": version}))
    (root / "latest").write_text(path.name)
    return path

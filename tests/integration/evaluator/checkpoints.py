"""Learner-format checkpoints of the tiny model, written without a learner (tests only)."""

from __future__ import annotations

from pathlib import Path

import torch

from asyncrlhf.config import LoraConfig
from asyncrlhf.models import load_policy, load_tokenizer, wrap_lora
from asyncrlhf.training.checkpoint import HF, LearnerState, publish, step_dir, write_state


def write_checkpoint(run_dir: Path, version: int, *, scale: float = 1.5, lora: bool = False) -> Path:
    """The checkpoint of `version` as the learner lays it out (`asyncrlhf.training.checkpoint`): HF weights
    (full model, or the LoRA adapter), learner state, and the `latest` pointer; the weights differ from the
    initial policy's. No DeepSpeed state: only the learner reads that."""
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
    path = step_dir(run_dir, version)
    policy.save_pretrained(path / HF, safe_serialization=True)
    load_tokenizer("tiny").save_pretrained(path / HF)
    write_state(path, LearnerState(version=version))
    publish(path)
    return path

"""The engine the vLLM tests share (started once per module, eager, fp32, on vLLM's CPU build here) and the
HF reference they compare it with."""

from __future__ import annotations

from collections.abc import Sequence

import torch

from asyncrlhf.config import Config, SamplingConfig, load_config
from asyncrlhf.sampling.hf import sampling_log_softmax

# The tiny model with head size 32 (64 / 2), one vLLM's CPU attention supports; fp32 like the learner.
OVERRIDES = ["model.tiny.heads=2", "model.dtype=float32", "generator.backend=vllm", "generator.device=cpu",
             "generator.vllm.kv_cache_gib=1", "generator.vllm.max_model_len=256"]
PARITY_ATOL = 1e-3  # nats per token


def vllm_config(cache_dir, *extra: str) -> Config:
    return load_config(["configs/tiny.yaml"], [f"model.cache_dir={cache_dir}", *OVERRIDES, *extra])


@torch.no_grad()
def reference_logprobs(model: torch.nn.Module, prompt: Sequence[int], completion: Sequence[int],
                       sampling: SamplingConfig) -> torch.Tensor:
    """Behaviour log-probs of `completion` under the HF `model` (the definition both backends share)."""
    full = torch.tensor([list(prompt) + list(completion)])
    logits = model(input_ids=full).logits[0, len(prompt) - 1:-1]
    return sampling_log_softmax(logits, sampling).gather(-1, torch.tensor(list(completion))[:, None])[:, 0]


def max_gap(model, prompts, groups, sampling) -> float:
    """Largest per-token |vLLM - HF| behaviour log-prob over every completion of every prompt."""
    gaps = [0.0]
    for prompt, group in zip(prompts, groups, strict=True):
        for c in group:
            expected = reference_logprobs(model, prompt, c.token_ids, sampling)
            gaps.append((torch.tensor(c.logprobs) - expected).abs().max().item())
    return max(gaps)

"""Completions and their log-probs for the offline stages and the evaluator, through the generator's
backends (no second sampler): the HF backend wraps the policy in hand; the vLLM backend is started once
with the run's model and receives each policy's weights as a generator receives a push.

Greedy decoding (`temperature: 0`) is sampling with top_k=1 at temperature 1, so the recorded log-probs
are the policy's own, log softmax(logits), the quantity the KL measure needs.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch
from torch import nn

from asyncrlhf.config import Config, SamplingConfig
from asyncrlhf.models import is_lora, resolve_device
from asyncrlhf.sampling.backend import Backend, Completion
from asyncrlhf.sampling.hf import HFBackend, completion_logprobs, left_pad
from asyncrlhf.version import PolicyVersion
from asyncrlhf.weights.codec import adapter_tensors


def sampling_for(temperature: float, max_new_tokens: int) -> SamplingConfig:
    """Evaluation sampling: temperature 0 means greedy."""
    if temperature == 0:
        return SamplingConfig(temperature=1.0, top_k=1, max_new_tokens=max_new_tokens)
    return SamplingConfig(temperature=temperature, max_new_tokens=max_new_tokens)


@dataclass(frozen=True)
class Generation:
    """One completion of one prompt, as `asyncrlhf generate` writes it."""

    prompt: str
    prompt_ids: list[int]
    completion: str
    completion_ids: list[int]
    finish: str
    loss_mask: list[int] | None = None  # an episode's: 1 on the model's tokens, 0 on the environment's

    def to_row(self, **extra) -> dict:
        row = {
            **extra,
            "prompt": self.prompt,
            "prompt_ids": self.prompt_ids,
            "completion": self.completion,
            "completion_ids": self.completion_ids,
            "finish": self.finish,
        }
        return row if self.loss_mask is None else {**row, "loss_mask": self.loss_mask}

    @classmethod
    def from_row(cls, row: dict) -> Generation:
        return cls(
            row["prompt"],
            list(row["prompt_ids"]),
            row["completion"],
            list(row["completion_ids"]),
            row.get("finish", "stop"),
            row.get("loss_mask"),
        )


class PolicySampler:
    """Samples from whichever policy it is handed, with the configured backend (`hf` or `vllm`)."""

    def __init__(
        self, cfg: Config, tokenizer, backend: str = "hf", device: str = "auto", batch_size: int = 16
    ):
        self.cfg, self.tokenizer, self.backend_name = cfg, tokenizer, backend
        self.device = resolve_device(device)
        self.batch_size = batch_size
        self._vllm: Backend | None = None

    def generate(
        self,
        policy: nn.Module,
        prompts: Sequence[str],
        prompt_ids: Sequence[Sequence[int]],
        k: int,
        sampling: SamplingConfig,
        version: int = 1,
    ) -> list[list[Generation]]:
        """k completions of each prompt: `out[i][j]` is the j-th of `prompts[i]`."""
        backend = self.backend(policy, version)
        out: list[list[Generation]] = []
        for start in range(0, len(prompt_ids), max(1, self.batch_size // k)):
            chunk = prompt_ids[start : start + max(1, self.batch_size // k)]
            for offset, samples in enumerate(backend.generate(chunk, k, sampling)):
                i = start + offset
                out.append([self._generation(prompts[i], prompt_ids[i], c) for c in samples])
        return out

    def _generation(self, prompt: str, prompt_ids: Sequence[int], c: Completion) -> Generation:
        text = self.tokenizer.decode(c.token_ids, skip_special_tokens=True)
        return Generation(prompt, list(prompt_ids), text, list(c.token_ids), c.finish)

    def backend(self, policy: nn.Module, version: int) -> Backend:
        """The configured backend, sampling from `policy` (its weights applied to vLLM as `version`)."""
        if self.backend_name == "hf":
            return HFBackend(
                policy, self.tokenizer.pad_token_id, eos_ids(policy, self.tokenizer), self.device
            )
        if self._vllm is None:
            from asyncrlhf.sampling.factory import create_backend

            generator = self.cfg.generator.model_copy(update={"backend": "vllm", "device": str(self.device)})
            lora = self.cfg.learner.lora.model_copy(update={"enabled": is_lora(policy)})
            learner = self.cfg.learner.model_copy(update={"lora": lora})
            self._vllm = create_backend(
                self.cfg.model_copy(update={"generator": generator, "learner": learner}), self.tokenizer
            )
        state = policy.state_dict()  # the policy's own tensors: copied, never adopted
        weights = adapter_tensors(state) if is_lora(policy) else state
        self._vllm.apply_weights(weights, PolicyVersion(0, version), adopt=False)  # lineage not recorded
        return self._vllm


def eos_ids(model: nn.Module, tokenizer) -> set[int]:
    configured = getattr(model.config, "eos_token_id", None)
    configured = configured if isinstance(configured, list) else [configured]
    return {tokenizer.eos_token_id, *configured} - {None}


@torch.no_grad()
def completion_token_logprobs(
    model: nn.Module,
    prompt_ids: Sequence[Sequence[int]],
    completion_ids: Sequence[Sequence[int]],
    pad_id: int,
    batch_size: int = 16,
) -> tuple[torch.Tensor, torch.Tensor]:
    """(B, T) log π(completion token | prompt, earlier tokens) at temperature 1, and the (B, T) mask."""
    model.eval()
    device = next(model.parameters()).device
    width = max(1, max(len(c) for c in completion_ids))
    new = torch.full((len(completion_ids), width), pad_id, dtype=torch.long)
    mask = torch.zeros((len(completion_ids), width))
    for row, ids in enumerate(completion_ids):
        new[row, : len(ids)] = torch.as_tensor(list(ids), dtype=torch.long)
        mask[row, : len(ids)] = 1.0
    parts = []
    for start in range(0, len(prompt_ids), batch_size):
        batch_ids, attention = left_pad(prompt_ids[start : start + batch_size], pad_id)
        parts.append(
            completion_logprobs(
                model, batch_ids.to(device), attention.to(device), new[start : start + batch_size].to(device),
                1.0,
            )
            .float()
            .cpu()
        )
    return torch.cat(parts) * mask, mask

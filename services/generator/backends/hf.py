"""The transformers backend: batched `generate` on CPU or GPU, then one forward pass for behaviour log-probs.

Prompts are left-padded into one batch of `len(prompts) * k` rows. Sampling uses only `generator.sampling`
(the model file's own generation defaults, such as a repetition penalty, are cleared at load, so the
distribution sampled is softmax(logits / temperature) truncated by top-k / top-p and nothing else).

Behaviour log-probs are recomputed by one forward pass over prompt + completion with the same positions as
`generate` used: exact log pi(token | prefix) under softmax(logits / temperature), the quantity the learner
recomputes for its importance ratios (`generate`'s `output_scores` would be post top-k / top-p instead).
"""

from __future__ import annotations

import logging
from typing import Mapping, Sequence

import torch
from torch import nn

from asyncrlhf.algorithms.logprobs import token_logprobs
from asyncrlhf.config import Config, SamplingConfig
from asyncrlhf.models import is_lora, load_policy, resolve_device, set_threads
from asyncrlhf.weights import adapter_tensors, swap_in
from services.generator.backends import Completion, Finish

log = logging.getLogger(__name__)

LOGPROB_ROWS = 16  # rows per log-prob forward pass: bounds the (rows, new_tokens, vocab) logits in memory


def left_pad(prompts: Sequence[Sequence[int]], pad_id: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(B, T) input ids and attention mask, shorter prompts padded on the left with `pad_id`."""
    if not prompts or any(len(p) == 0 for p in prompts):
        raise ValueError("every prompt needs at least one token")
    width = max(len(p) for p in prompts)
    ids = torch.full((len(prompts), width), pad_id, dtype=torch.long)
    mask = torch.zeros((len(prompts), width), dtype=torch.long)
    for row, prompt in enumerate(prompts):
        ids[row, width - len(prompt):] = torch.as_tensor(list(prompt), dtype=torch.long)
        mask[row, width - len(prompt):] = 1
    return ids, mask


def positions(mask: torch.Tensor) -> torch.Tensor:
    """(B, T) position ids that count only real tokens (what `generate` uses with left padding)."""
    return (mask.cumsum(-1) - 1).clamp(min=0)


def trim_at_eos(token_ids: Sequence[int], eos_ids: set[int]) -> tuple[list[int], Finish]:
    """The completion up to and including its first EOS ("stop"), or all of it ("length")."""
    for i, token in enumerate(token_ids):
        if token in eos_ids:
            return list(token_ids[: i + 1]), "stop"
    return list(token_ids), "length"


@torch.no_grad()
def completion_logprobs(model: nn.Module, prompt_ids: torch.Tensor, prompt_mask: torch.Tensor,
                        new_ids: torch.Tensor, temperature: float) -> torch.Tensor:
    """(B, N) log-probs of `new_ids` (B, N) given the left-padded prompts (B, T), under logits / temperature.

    Tokens after a row's EOS are scored too (as padding continuations); callers cut them off."""
    full = torch.cat([prompt_ids, new_ids], dim=1)
    mask = torch.cat([prompt_mask, torch.ones_like(new_ids)], dim=1)
    n = new_ids.shape[1]
    out = model(input_ids=full, attention_mask=mask, position_ids=positions(mask), logits_to_keep=n + 1)
    logits = out.logits[:, -(n + 1):-1]  # position t predicts token t + 1
    return token_logprobs(logits, new_ids, temperature)


class HFBackend:
    """A transformers causal LM (LoRA-wrapped in a LoRA run, so pushed adapter names match)."""

    def __init__(self, model: nn.Module, pad_id: int, eos_ids: set[int], device: torch.device):
        from transformers import GenerationConfig

        self.model, self.pad_id, self.eos_ids, self.device = model.eval(), pad_id, eos_ids, device
        self.model.requires_grad_(False)
        generation_owner = model.get_base_model() if is_lora(model) else model
        generation_owner.generation_config = GenerationConfig(
            eos_token_id=sorted(eos_ids), pad_token_id=pad_id,
            bos_token_id=generation_owner.config.bos_token_id)
        state = model.state_dict(keep_vars=True)
        self._live = adapter_tensors(state) if is_lora(model) else dict(state)
        self._version = 0

    @classmethod
    def from_config(cls, cfg: Config, tokenizer) -> "HFBackend":
        set_threads(cfg.generator.threads)
        torch.manual_seed(cfg.run.seed)
        device = resolve_device(cfg.generator.device)
        model = load_policy(cfg.model, lora=cfg.learner.lora, device=str(device))
        configured = getattr(model.config, "eos_token_id", None)
        configured = configured if isinstance(configured, list) else [configured]
        eos = {tokenizer.eos_token_id, *configured} - {None}
        return cls(model, tokenizer.pad_token_id, eos, device)

    @property
    def version(self) -> int:
        return self._version

    def named_tensors(self) -> Mapping[str, torch.Tensor]:
        return self._live

    def apply_weights(self, tensors: Mapping[str, torch.Tensor], version: int) -> dict[str, torch.Tensor]:
        replaced = swap_in(self._live, tensors)  # adopts the staged tensors where it can: no copy
        self._version = version
        return replaced

    @torch.no_grad()
    def generate(self, prompts: Sequence[Sequence[int]], k: int,
                 sampling: SamplingConfig) -> list[list[Completion]]:
        ids, mask = left_pad([p for p in prompts for _ in range(k)], self.pad_id)
        ids, mask = ids.to(self.device), mask.to(self.device)
        out = self.model.generate(
            input_ids=ids, attention_mask=mask, do_sample=True, temperature=sampling.temperature,
            top_p=sampling.top_p, top_k=sampling.top_k, max_new_tokens=sampling.max_new_tokens,
        )
        new = out[:, ids.shape[1]:]
        logps = torch.cat([
            completion_logprobs(self.model, ids[i:i + LOGPROB_ROWS], mask[i:i + LOGPROB_ROWS],
                                new[i:i + LOGPROB_ROWS], sampling.temperature)
            for i in range(0, new.shape[0], LOGPROB_ROWS)
        ]).cpu()
        rows = []
        for row, tokens in enumerate(new.cpu().tolist()):
            kept, finish = trim_at_eos(tokens, self.eos_ids)
            rows.append(Completion(kept, logps[row, : len(kept)].tolist(), finish))
        return [rows[i * k:(i + 1) * k] for i in range(len(prompts))]

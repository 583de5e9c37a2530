"""A sequence-classification reward model as a scorer: batched, length-limited, on CPU or GPU.

The model reads `prompt + completion` as its tokenizer encodes it and scores it at the last token. Inputs
longer than the limit (`reward.max_length`, capped by the model's position embeddings) keep their *last*
tokens: the completion's end is what the head reads, so cutting the prompt's start loses the least. Each
truncated input is counted in `ScoreResult.truncated` (the service exports it as a metric).

The model is one the run names (`asyncrlhf.run_models.scorer_model`): a local directory, a checkpoint, `tiny`,
or a hub id at a pinned revision under the run's `model.allow_hub`, in the scorer's dtype.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence

import torch

from asyncrlhf.config import ModelConfig
from asyncrlhf.models import as_model_config, load_score_model, load_tokenizer, resolve_device
from asyncrlhf.rewards.base import ScoreResult

log = logging.getLogger(__name__)


class ModelScorer:
    """Scores with a 1-output sequence-classification model (`load_score_model`: an HF dir, an RM
    checkpoint, a hub id, or `tiny`)."""

    def __init__(self, model: ModelConfig | str, *, batch_size: int = 16, max_length: int = 512,
                 device: str = "auto"):
        cfg = as_model_config(model)
        self.device = resolve_device(device)
        self.model = load_score_model(cfg, device=str(self.device)).eval()
        self.tokenizer = load_tokenizer(cfg)
        self.pad_id = self.model.config.pad_token_id
        if self.pad_id is None:
            self.pad_id = self.tokenizer.pad_token_id
        positions = getattr(self.model.config, "max_position_embeddings", None) or max_length
        self.max_length = min(max_length, positions)
        self.batch_size = batch_size
        log.info("reward model %s%s on %s in %s, max_length=%d", cfg.name_or_path,
                 f" at {cfg.revision}" if cfg.revision else "", self.device, cfg.dtype, self.max_length)

    @torch.no_grad()
    def score(
        self, prompts: Sequence[str], completions: Sequence[str], labels: Sequence[str] | None = None
    ) -> ScoreResult:
        texts = [p + c for p, c in zip(prompts, completions, strict=True)]
        ids = self.tokenizer(texts)["input_ids"]
        truncated = sum(len(x) > self.max_length for x in ids)
        ids = [x[-self.max_length :] or [self.pad_id] for x in ids]  # an empty text still gets a score
        scores: list[float] = []
        for start in range(0, len(ids), self.batch_size):
            input_ids, attention_mask = self._pad(ids[start : start + self.batch_size])
            logits = self.model(input_ids=input_ids, attention_mask=attention_mask).logits  # (b, 1)
            scores += logits[:, 0].float().tolist()
        return ScoreResult(scores, truncated=truncated)

    def _pad(self, batch: list[list[int]]) -> tuple[torch.Tensor, torch.Tensor]:
        """Right-pad to (b, T): the head pools at the last non-pad token."""
        width = max(len(x) for x in batch)
        input_ids = torch.full((len(batch), width), self.pad_id, dtype=torch.long)
        attention_mask = torch.zeros((len(batch), width), dtype=torch.long)
        for row, x in enumerate(batch):
            input_ids[row, : len(x)] = torch.tensor(x)
            attention_mask[row, : len(x)] = 1
        return input_ids.to(self.device), attention_mask.to(self.device)

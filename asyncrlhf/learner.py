"""The learner's construction, shared by the learner service and the in-process baseline of
`asyncrlhf bench pipeline`: threads, the process group, the effective config (a user DeepSpeed JSON wins for
what it sets), the seeded models and DeepSpeed engines, the trainer, and the training prompts as the feed
enqueues them."""

from __future__ import annotations

from dataclasses import dataclass
from functools import cached_property
from typing import Any

import torch

from asyncrlhf.config import Config
from asyncrlhf.inbox.prompts import PromptSet, prompt_set
from asyncrlhf.models import load_tokenizer, set_threads
from asyncrlhf.training import engine
from asyncrlhf.training.objectives import Objective, make_objective
from asyncrlhf.training.policies import LearnerModels, build_models
from asyncrlhf.training.trainer import Trainer


@dataclass
class LearnerParts:
    cfg: Config  # as in effect
    rank: int
    world: int
    tokenizer: Any  # a Hugging Face tokenizer
    objective: Objective
    models: LearnerModels
    trainer: Trainer

    @cached_property
    def prompts(self) -> PromptSet:
        """The task's training prompts fitted to the model (only the rank that enqueues needs them)."""
        return prompt_set(self.cfg, self.tokenizer)


def build_learner(cfg: Config) -> LearnerParts:
    """Everything a learner process trains with, seeded by `run.seed`."""
    set_threads(cfg.learner.threads)
    rank, world = engine.init_distributed()
    cfg = cfg.model_copy(update={"learner": engine.effective_learner(cfg.learner)})
    torch.manual_seed(cfg.run.seed)
    tokenizer = load_tokenizer(cfg.model)
    objective = make_objective(cfg)
    models = build_models(cfg, objective)
    trainer = Trainer(cfg, models, objective=objective, pad_id=tokenizer.pad_token_id, rank=rank, world=world)
    return LearnerParts(cfg, rank, world, tokenizer, objective, models, trainer)

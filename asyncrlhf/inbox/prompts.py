"""The training prompts as the learner enqueues them: the task's prompts fitted to the model, in the feed's
order (a permutation per epoch seeded by `run.seed + epoch`), each group named by its cursor. Shared by the
learner's feed and the in-process baseline, so both walk the same groups."""

from __future__ import annotations

import time
from dataclasses import dataclass, field

from asyncrlhf._proto.rollout_pb2 import PromptGroup
from asyncrlhf.config import Config
from asyncrlhf.inbox.ids import group_id
from asyncrlhf.models import encode_prompts
from asyncrlhf.tasks import PromptOrder, fit_prompts, load_task, plain_text


@dataclass
class PromptSet:
    """Prompt texts and their token ids (aligned), `k` samples each, in `order`."""

    texts: list[str]
    token_ids: list[list[int]]
    k: int
    seed: int
    references: list[str | None] = field(default_factory=list)  # a verifiable reward's answers

    def __post_init__(self) -> None:
        if not self.texts:
            raise ValueError("the task has no training prompts")
        self.references = list(self.references) or [None] * len(self.texts)
        self.order = PromptOrder(len(self.texts), self.seed)

    def __len__(self) -> int:
        return len(self.texts)

    def group(self, cursor: int, version: int, lineage: int = 0) -> PromptGroup:
        """The cursor-th group ever enqueued, stamped with the learner's version and lineage."""
        epoch, index = self.order.position(cursor)
        return PromptGroup(
            group_id=group_id(cursor), prompt=self.texts[index], prompt_token_ids=self.token_ids[index],
            k=self.k, enqueued_at=time.time(), learner_version=version, dataset_index=index, epoch=epoch,
            reference=self.references[index] or "", lineage=lineage,
        )


def prompt_set(cfg: Config, tokenizer) -> PromptSet:
    """The task's training prompts fitted to `model.max_prompt_tokens` (`task.too_long`: truncate, fail or
    drop; lengths are measured before truncation)."""
    task = load_task(cfg.task)
    whole = cfg.model.model_copy(update={"max_prompt_tokens": 1 << 30})
    task, token_ids = fit_prompts(task, encode_prompts(tokenizer, task.train, whole),
                                  cfg.model.max_prompt_tokens, cfg.task)
    return PromptSet([plain_text(p) for p in task.train], token_ids, k=cfg.generator.samples_per_prompt,
                     seed=cfg.run.seed, references=list(task.train_references))


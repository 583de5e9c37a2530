"""Prompt sources: the shipped tasks (`demo`; `varlen`, answers from one sentence to a long one,
`tasks/varlen.py`; `arithmetic` and `calculator`, questions with answers for tool use), the user's JSONL files
(`task.name: jsonl`), or Hugging Face datasets (`task.name: hf`, `tasks/hf.py`). A prompt is a string or a
chat `messages` list."""

from __future__ import annotations

import json
import logging
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path

import torch

from asyncrlhf.config import TaskConfig
from asyncrlhf.tasks import arithmetic, demo, varlen
from asyncrlhf.tasks.hf import HFTaskError, Prompt

log = logging.getLogger("asyncrlhf.tasks")


class TaskError(ValueError):
    """A task's data cannot be read; the message says which file or field."""


@dataclass(frozen=True)
class Task:
    train: Sequence[Prompt]
    eval: Sequence[Prompt]
    train_references: list[str | None] = field(default_factory=list)  # aligned with `train`; empty: none
    eval_references: list[str | None] = field(default_factory=list)  # aligned with `eval`; empty: none


def fit_prompts(
    task: Task, ids: list[list[int]], max_tokens: int, cfg: TaskConfig
) -> tuple[Task, list[list[int]]]:
    """Apply `task.too_long` to training prompts whose (untruncated) token ids exceed `max_tokens`: keep
    them (their last tokens, as the encoder truncates), fail naming the first, or drop them. `ids` align with
    `task.train`; returns the task and the kept prompts' ids, truncated: one encoding serves both."""
    long = [i for i, x in enumerate(ids) if len(x) > max_tokens]
    if not long or cfg.too_long == "truncate":
        if long:
            log.info("%d of %d prompts exceed model.max_prompt_tokens=%d: their last tokens are kept",
                     len(long), len(ids), max_tokens)
        return task, [x[-max_tokens:] for x in ids]
    where = f"{cfg.dataset or cfg.train_path or cfg.name}, row {long[0]}, field `{cfg.prompt_field}`"
    if cfg.too_long == "fail":
        raise TaskError(f"{where}: the prompt is {len(ids[long[0]])} tokens, over model.max_prompt_tokens="
                        f"{max_tokens} ({len(long)} such prompts); raise the limit, or set task.too_long to "
                        "truncate or skip")
    keep = [i for i in range(len(ids)) if i not in set(long)]
    log.warning("skipped %d of %d prompts over model.max_prompt_tokens=%d (task.too_long=skip)", len(long),
                len(ids), max_tokens)
    if not keep:
        raise TaskError(f"every prompt of {where.split(',')[0]} is over model.max_prompt_tokens={max_tokens}")
    refs = [task.train_references[i] for i in keep] if task.train_references else []
    kept = Task(train=[task.train[i] for i in keep], eval=task.eval, train_references=refs,
                eval_references=task.eval_references)
    return kept, [ids[i] for i in keep]


class PromptOrder:
    """The order prompts are enqueued in: a fresh permutation per epoch, seeded `seed + epoch`, so a resumed
    learner (or the in-process baseline) walks the same order from any cursor."""

    def __init__(self, size: int, seed: int):
        self.size, self.seed = size, seed
        self._orders: dict[int, list[int]] = {}  # the current epoch's only

    def position(self, cursor: int) -> tuple[int, int]:
        """(epoch, dataset index) of the cursor-th group ever enqueued."""
        epoch, offset = divmod(cursor, self.size)
        if epoch not in self._orders:
            generator = torch.Generator().manual_seed(self.seed + epoch)
            self._orders = {epoch: torch.randperm(self.size, generator=generator).tolist()}
        return epoch, self._orders[epoch][offset]


def plain_text(prompt: Prompt) -> str:
    """A prompt as one string for scorers and logs: a chat prompt's last user message."""
    if isinstance(prompt, str):
        return prompt
    return next((m["content"] for m in reversed(prompt) if m["role"] == "user"), prompt[-1]["content"])


def load_task(cfg: TaskConfig) -> Task:
    if cfg.name == "demo":
        return Task(train=demo.train_prompts(), eval=demo.eval_prompts())
    if cfg.name == "varlen":
        return Task(train=varlen.train_prompts(), eval=varlen.eval_prompts())
    if cfg.name in ("arithmetic", "calculator"):
        train, answers, held, held_answers = arithmetic.split(cfg.name)
        return Task(train=train, eval=held, train_references=list(answers),
                    eval_references=list(held_answers))
    if cfg.name == "jsonl":
        if not cfg.train_path:
            raise TaskError(
                "task `jsonl` needs task.train_path (a JSONL file with a `prompt` field per line)"
            )
        train = read_jsonl_prompts(Path(cfg.train_path), cfg.prompt_field)
        held_out = read_jsonl_prompts(Path(cfg.eval_path), cfg.prompt_field) if cfg.eval_path else []
        return Task(train=train, eval=held_out)
    if cfg.name == "hf":
        return _load_hf(cfg)
    raise TaskError(f"unknown task `{cfg.name}`; use `demo`, `varlen`, `arithmetic`, `calculator`, `jsonl` "
                    "or `hf`")


def _load_hf(cfg: TaskConfig) -> Task:
    from asyncrlhf.tasks import hf

    try:
        train, references = hf.load_split(cfg, cfg.split)
        held_out, eval_refs = hf.load_split(cfg, cfg.eval_split) if cfg.eval_split else ([], [])
    except HFTaskError as err:
        raise TaskError(str(err)) from None
    if not cfg.reference_field:
        references, eval_refs = [], []
    return Task(train=train, eval=held_out, train_references=references, eval_references=eval_refs)


def read_jsonl_prompts(path: Path, field: str) -> list[str]:
    if not path.is_file():
        raise TaskError(f"prompt file {path} does not exist")
    out = []
    for n, line in enumerate(path.read_text().splitlines(), start=1):
        if not line.strip():
            continue
        try:
            row = json.loads(line)
        except json.JSONDecodeError as err:
            raise TaskError(f"{path}:{n}: not JSON ({err})") from None
        if not isinstance(row, dict) or not isinstance(row.get(field), str):
            raise TaskError(f"{path}:{n}: expected an object with a string `{field}` field")
        out.append(row[field])
    if not out:
        raise TaskError(f"{path} holds no prompts")
    return out

"""Prompt sources: the shipped demo task, or the user's JSONL files (`task.name: jsonl`)."""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

from asyncrlhf.config import TaskConfig
from asyncrlhf.tasks import demo


class TaskError(ValueError):
    """A task's data cannot be read; the message says which file or field."""


@dataclass(frozen=True)
class Task:
    train: list[str]
    eval: list[str]


def load_task(cfg: TaskConfig) -> Task:
    if cfg.name == "demo":
        return Task(train=demo.train_prompts(), eval=demo.eval_prompts())
    if cfg.name == "jsonl":
        if not cfg.train_path:
            raise TaskError(
                "task `jsonl` needs task.train_path (a JSONL file with a `prompt` field per line)"
            )
        train = read_jsonl_prompts(Path(cfg.train_path), cfg.prompt_field)
        held_out = read_jsonl_prompts(Path(cfg.eval_path), cfg.prompt_field) if cfg.eval_path else []
        return Task(train=train, eval=held_out)
    raise TaskError(f"unknown task `{cfg.name}`; use `demo` or `jsonl`")


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

"""Task `hf`: prompts (and reference answers) read with the Hugging Face `datasets` library.

`task.dataset` is a `save_to_disk` directory, local .parquet/.json/.jsonl/.csv files, or a hub name (with
`task.subset` and a pinned `task.revision`). Each row's `task.prompt_field` is a string, or a chat `messages`
list of {role, content} (rendered later with the tokenizer's chat template, `model.system_prompt` prepended
when the data has no system message). Every row is checked at start: a missing field, a wrong type or an
empty split fails naming the source, row and field, or (`task.on_bad_row: skip`) the row is skipped and
counted.
"""

from __future__ import annotations

import logging
import re
from pathlib import Path
from typing import Any

from asyncrlhf.config import TaskConfig

log = logging.getLogger("asyncrlhf.tasks")
Prompt = str | list[dict[str, str]]
_BUILDERS = {".parquet": "parquet", ".json": "json", ".jsonl": "json", ".csv": "csv"}


class HFTaskError(ValueError):
    """The dataset cannot be used as configured; the message names the source, row and field."""


def load_split(cfg: TaskConfig, split: str) -> tuple[list[Prompt], list[str | None]]:
    """(prompts, references) of `split`; references are None where `task.reference_field` is unset."""
    rows = _open(cfg, split)
    source = f"{cfg.dataset} split `{split}`"
    if cfg.max_examples is not None:
        rows = rows.select(range(min(cfg.max_examples, len(rows))))
    pattern = re.compile(cfg.reference_pattern, re.MULTILINE) if cfg.reference_pattern else None
    prompts: list[Prompt] = []
    references: list[str | None] = []
    skipped = 0
    for index, row in enumerate(rows):
        try:
            prompt = _prompt(row, cfg.prompt_field)
            reference = _reference(row, cfg.reference_field, pattern) if cfg.reference_field else None
        except HFTaskError as err:
            if cfg.on_bad_row == "skip":
                skipped += 1
                continue
            hint = "(or set task.on_bad_row=skip to skip such rows)"
            raise HFTaskError(f"{source}, row {index}: {err} {hint}") from None
        prompts.append(prompt)
        references.append(reference)
    if skipped:
        log.warning("%s: skipped %d bad rows of %d (task.on_bad_row=skip)", source, skipped, len(rows))
    if not prompts:
        raise HFTaskError(f"{source} has no usable rows ({len(rows)} rows, {skipped} skipped): check "
                          "task.split, task.prompt_field and the data")
    return prompts, references


def _open(cfg: TaskConfig, split: str):
    import datasets

    if not cfg.dataset:
        raise HFTaskError("task `hf` needs task.dataset: a hub name, a save_to_disk directory, or data files")
    files = [p.strip() for p in cfg.dataset.split(",")]
    local = Path(files[0]).expanduser()
    try:
        if local.is_dir() and any((local / f).is_file() for f in ("dataset_dict.json", "dataset_info.json")):
            loaded = datasets.load_from_disk(str(local))
            is_dict = isinstance(loaded, datasets.DatasetDict)
            data = loaded[split] if is_dict else _only_split(loaded, split, cfg)
        elif local.suffix in _BUILDERS:
            missing = [f for f in files if not Path(f).expanduser().is_file()]
            if missing:
                raise HFTaskError(f"task.dataset: no such file {missing[0]}")
            data = datasets.load_dataset(_BUILDERS[local.suffix], data_files={split: files}, split=split)
        elif local.exists():
            raise HFTaskError(f"task.dataset {local}: not a save_to_disk directory nor a "
                              f"{'/'.join(_BUILDERS)} file")
        else:
            data = datasets.load_dataset(cfg.dataset, cfg.subset, split=split, revision=cfg.revision)
    except KeyError:
        raise HFTaskError(f"{cfg.dataset} has no split `{split}`: set task.split / task.eval_split") from None
    except (FileNotFoundError, ValueError) as err:
        if isinstance(err, HFTaskError):
            raise
        if "corresponds to no data" in str(err):  # how `datasets` says a split has no rows
            raise HFTaskError(f"{cfg.dataset} split `{split}` is empty") from None
        raise HFTaskError(f"task.dataset {cfg.dataset} split `{split}` cannot be read: {err}") from err
    if len(data) == 0:
        raise HFTaskError(f"{cfg.dataset} split `{split}` is empty")
    return data


def _only_split(data, split: str, cfg: TaskConfig):
    """A directory holding one Dataset (no splits) is the training split."""
    if split != cfg.split:
        raise KeyError(split)
    return data


def _prompt(row: dict[str, Any], field: str) -> Prompt:
    if field not in row or row[field] is None:
        raise HFTaskError(f"no field `{field}` (the row has {sorted(row)}): set task.prompt_field")
    value = row[field]
    if isinstance(value, str):
        if not value.strip():
            raise HFTaskError(f"field `{field}` is an empty string")
        return value
    if isinstance(value, list) and value and all(_is_message(m) for m in value):
        return [{"role": m["role"], "content": m["content"]} for m in value]
    raise HFTaskError(f"field `{field}` must be a string or a list of {{role, content}} messages, got "
                      f"{type(value).__name__} {str(value)[:80]!r}")


def _is_message(m: Any) -> bool:
    return isinstance(m, dict) and isinstance(m.get("role"), str) and isinstance(m.get("content"), str)


def _reference(row: dict[str, Any], field: str, pattern: re.Pattern | None) -> str:
    value = row.get(field)
    if isinstance(value, bool) or not isinstance(value, str | int | float):
        raise HFTaskError(f"reference field `{field}` must be a string or a number, got {value!r:.80}: set "
                          "task.reference_field")
    text = str(value)
    if pattern is None:
        return text.strip()
    found = pattern.search(text)
    if not found:
        raise HFTaskError(f"reference field `{field}` does not match task.reference_pattern "
                          f"{pattern.pattern!r}: {text[-80:]!r}")
    return (found.group(1) if found.groups() else found.group(0)).strip()

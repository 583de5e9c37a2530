"""What every offline stage shares: its own flags beside the config arguments, paths under the run
directory, JSONL and `datasets` records, and the `stages.jsonl` log the report reads."""

from __future__ import annotations

import json
import signal
import time
from collections.abc import Callable, Iterable, Sequence
from pathlib import Path
from typing import Any

from asyncrlhf.config import Config
from asyncrlhf.service import run_service

STAGES_LOG = "stages.jsonl"


class StageError(ValueError):
    """A stage cannot run as asked; the message says what to change."""


def split_flags(argv: Sequence[str], flags: dict[str, bool]) -> tuple[dict[str, list[str]], list[str]]:
    """Pull a stage's own flags out of argv; the rest are config files and overrides.

    `flags` maps a flag (`--checkpoint`) to whether it takes several values (`--checkpoint A B`); a
    multi-value flag takes arguments up to the next one starting with `--` or containing `=`.
    """
    found: dict[str, list[str]] = {}
    rest: list[str] = []
    args = list(argv)
    i = 0
    while i < len(args):
        arg = args[i]
        name, eq, value = arg.partition("=")
        if name in flags:
            values = [value] if eq else []
            i += 1
            while (
                i < len(args)
                and (not values or flags[name])
                and not args[i].startswith("--")
                and "=" not in args[i]
            ):
                values.append(args[i])
                i += 1
            if not values:
                raise StageError(f"{name} needs a value")
            found.setdefault(name, []).extend(values)
            continue
        rest.append(arg)
        i += 1
    return found, rest


def run_stage(
    body: Callable[..., int],
    argv: Sequence[str],
    name: str,
    flags: dict[str, bool] | None = None,
    required: Sequence[str] = (),
) -> int:
    """`main` of a stage: its flags, then config + logging through `run_service`; StageError exits 2."""
    try:
        found, rest = split_flags(argv, flags or {})
        missing = [flag for flag in required if flag not in found]
        if missing:
            raise StageError(f"missing {', '.join(missing)}")
    except StageError as err:
        print(f"asyncrlhf {name}: {err}", flush=True)
        return 2

    def guarded(cfg: Config, log, stop) -> int:
        # An offline stage has no loop to wind down: Ctrl-C and SIGTERM stop it at once.
        signal.signal(signal.SIGINT, signal.default_int_handler)
        signal.signal(signal.SIGTERM, signal.SIG_DFL)
        try:
            return int(body(cfg, log, found) or 0)
        except StageError as err:
            log.error("%s", err)
            return 2

    return run_service(guarded, rest, name)


def run_path(cfg: Config, template: str) -> Path:
    """A stage path from the config: `{run_dir}` expands to the run directory."""
    return Path(template.format(run_dir=cfg.run.path)).expanduser()


def read_jsonl(path: Path) -> list[dict[str, Any]]:
    if not path.is_file():
        raise StageError(f"{path} does not exist")
    rows = []
    for n, line in enumerate(path.read_text().splitlines(), start=1):
        if line.strip():
            try:
                rows.append(json.loads(line))
            except json.JSONDecodeError as err:
                raise StageError(f"{path}:{n}: not JSON ({err})") from None
    return rows


def write_jsonl(path: Path, rows: Iterable[dict[str, Any]]) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.tmp")
    with tmp.open("w") as f:
        for row in rows:
            f.write(json.dumps(row) + "\n")
    tmp.replace(path)
    return path


def read_records(path: str | Path, fields: Sequence[str]) -> list[dict[str, Any]]:
    """Rows of a JSONL file or a local `datasets` directory (`save_to_disk`), each with string `fields`."""
    path = Path(path).expanduser()
    if path.is_dir():
        try:
            from datasets import load_from_disk
        except ImportError:
            raise StageError(
                f"{path} is a directory: reading a `datasets` directory needs `pip install datasets`"
                "; or pass a JSONL file"
            ) from None
        data = load_from_disk(str(path))
        rows = [dict(r) for r in (data["train"] if hasattr(data, "keys") and "train" in data else data)]
    else:
        rows = read_jsonl(path)
    for n, row in enumerate(rows, start=1):
        bad = [f for f in fields if not isinstance(row.get(f), str)]
        if bad:
            raise StageError(f"{path}: row {n} needs string field(s) {', '.join(bad)}; it has {sorted(row)}")
    if not rows:
        raise StageError(f"{path} holds no rows")
    return rows


def log_stage(cfg: Config, stage: str, **summary: Any) -> dict[str, Any]:
    """Append a stage's summary to `<run.dir>/stages.jsonl` (the report lists them) and return it."""
    row = {"stage": stage, "time": time.time(), **summary}
    path = cfg.run.path / STAGES_LOG
    path.parent.mkdir(parents=True, exist_ok=True)
    with path.open("a") as f:
        f.write(json.dumps(row) + "\n")
    return row


def take(items: Sequence, n: int) -> list:
    """The first n items (0: all)."""
    return list(items[:n] if n else items)

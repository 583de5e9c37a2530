"""The consumed log, `<run dir>/consumed.jsonl`: an append-only, fsynced record of every group id the learner
trained, dropped as stale or counted as dead-lettered, one row per step or event. It is what makes training
exactly-once (a redelivered group already in it is acked, never trained again) and what `asyncrlhf audit`
and the report read (`read_rows`)."""

from __future__ import annotations

import json
import os
import time
from pathlib import Path

CONSUMED_LOG = "consumed.jsonl"


class ConsumedLog:
    def __init__(self, path: Path):
        self.path = path
        self.ids: set[str] = set()
        if path.exists():
            for line in path.read_text().splitlines():
                if line.strip():
                    self.ids.update(json.loads(line)["group_ids"])

    def append(self, kind: str, version: int, group_ids: list[str], **extra) -> None:
        self.path.parent.mkdir(parents=True, exist_ok=True)
        row = {"kind": kind, "version": version, "group_ids": group_ids, "at": time.time(), **extra}
        with self.path.open("a") as f:
            f.write(json.dumps(row) + "\n")
            f.flush()
            os.fsync(f.fileno())
        self.ids.update(group_ids)


def read_rows(run_dir: Path) -> list[dict]:
    """Every row of a run's consumed log, oldest first ([] before the first step)."""
    path = run_dir / CONSUMED_LOG
    if not path.exists():
        return []
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]

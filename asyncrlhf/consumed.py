"""The consumed log, `<run dir>/consumed.jsonl`: an append-only, fsynced record of every group id the learner
trained, dropped as stale or counted as dead-lettered, one row per step or event, and of every learner start
(lineage). It is what makes training exactly-once (a redelivered group already in it is acked, never trained
again) and what `asyncrlhf audit`, the report and the benches read. This module owns its file name
(`log_path`), its row kinds (`Kind`) and its reading (`read_rows`, `rows_of`).

Lineages. Every learner start appends `{"kind": "lineage", "lineage": L, "from_lineage": P, "version": c}`
before it pushes anything: lineage L continues the model of lineage P at version c (the checkpoint it
resumed; P = 0: fresh weights). Each `trained` row names its lineage and the version its update produced.
The *history* of lineage L is its own trained rows, then P's rows up to version c, then P's parent's up to
where P started, and so on: exactly the updates that the model of L contains. A group trained in a lineage
but outside the current history (trained after the checkpoint that the next start resumed from) lost its
update; the learner trains it again (`requeued` row), so every group ends in the final history exactly once.
"""

from __future__ import annotations

import json
import os
import time
from dataclasses import dataclass, field
from enum import StrEnum
from pathlib import Path

CONSUMED_LOG = "consumed.jsonl"


class Kind(StrEnum):
    """A row's `kind`: a learner start, or how groups ended (trained, dropped, dead-lettered, filtered by
    dynamic sampling), or groups enqueued again (requeued)."""

    LINEAGE = "lineage"
    TRAINED = "trained"
    DROPPED = "dropped"
    DEAD_LETTERED = "dead_lettered"
    REQUEUED = "requeued"
    FILTERED = "filtered"  # no reward signal (learner.dynamic_sampling): not trained, its step refilled


ENDED_WITHOUT_TRAINING = (Kind.DROPPED, Kind.DEAD_LETTERED, Kind.FILTERED)
ENDINGS = (Kind.TRAINED, *ENDED_WITHOUT_TRAINING)


def log_path(run_dir: Path) -> Path:
    """Where a run's consumed log is."""
    return Path(run_dir) / CONSUMED_LOG


@dataclass
class History:
    """Which (lineage, version) updates the model of `lineage` contains, from the log's lineage rows."""

    lineage: int = 0
    parents: dict[int, tuple[int, int]] = field(default_factory=dict)  # lineage -> (from lineage, version)

    def chain(self) -> list[tuple[int, float]]:
        """(lineage, highest version of it in the history), newest lineage first."""
        out: list[tuple[int, float]] = []
        current, upper, seen = self.lineage, float("inf"), set()
        while current and current not in seen:
            seen.add(current)
            out.append((current, upper))
            current, version = self.parents.get(current, (0, 0))
            upper = version
        out.append((0, upper))  # rows written before lineages existed (lineage 0), up to where lineages began
        return out

    def contains(self, lineage: int, version: int) -> bool:
        return any(lineage == lin and version <= upper for lin, upper in self.chain())


def history_of(rows: list[dict], lineage: int | None = None) -> History:
    """The history of `lineage` (default: the last one started) from a log's rows."""
    parents = {r["lineage"]: (r.get("from_lineage", 0), r.get("version", 0))
               for r in rows if r["kind"] == Kind.LINEAGE}
    last = max(parents, default=0)
    return History(last if lineage is None else lineage, parents)


def ended_ids(rows: list[dict], history: History) -> set[str]:
    """Groups that ended for the model of `history`: trained in it, dropped, or dead-lettered."""
    ended: set[str] = set()
    for row in rows:
        if row["kind"] == Kind.TRAINED and history.contains(row.get("lineage", 0), row["version"]):
            ended.update(row["group_ids"])
        elif row["kind"] in ENDED_WITHOUT_TRAINING:
            ended.update(row["group_ids"])
    return ended


class ConsumedLog:
    """The learner's handle on the log. `ids` are the groups that ended for the current lineage's model (the
    ones a redelivery must not train again); `begin` starts a lineage."""

    def __init__(self, path: Path):
        self.path = path
        self.rows = _read(path)
        self.history = history_of(self.rows)
        self.ids = ended_ids(self.rows, self.history)

    @property
    def lineage(self) -> int:
        return self.history.lineage

    def begin(self, from_lineage: int, from_version: int) -> int:
        """Start a new lineage continuing `from_lineage` at `from_version` (the resumed checkpoint; 0 for
        fresh weights); returns it. Groups trained outside its history are no longer in `ids`."""
        lineage = max([self.history.lineage, from_lineage, *self.history.parents]) + 1
        self.append(Kind.LINEAGE, from_version, [], lineage=lineage, from_lineage=from_lineage)
        self.history = history_of(self.rows, lineage)
        self.ids = ended_ids(self.rows, self.history)
        return lineage

    def trained_elsewhere(self) -> set[str]:
        """Groups that were trained, but not in the current history and not ended since: updates lost."""
        trained = {g for r in self.rows if r["kind"] == Kind.TRAINED for g in r["group_ids"]}
        return trained - self.ids

    def append(self, kind: Kind, version: int, group_ids: list[str], **extra) -> None:
        self.path.parent.mkdir(parents=True, exist_ok=True)
        row = {"kind": kind, "version": version, "group_ids": group_ids, "at": time.time(), **extra}
        row.setdefault("lineage", self.lineage)
        with self.path.open("a") as f:
            f.write(json.dumps(row) + "\n")
            f.flush()
            os.fsync(f.fileno())
        self.rows.append(row)
        if kind != Kind.REQUEUED:
            self.ids.update(group_ids)


def read_rows(run_dir: Path) -> list[dict]:
    """Every row of a run's consumed log, oldest first ([] before the first step)."""
    return _read(log_path(run_dir))


def rows_of(run_dir: Path, *kinds: Kind) -> list[dict]:
    """The rows of `kinds`, oldest first."""
    return [r for r in read_rows(run_dir) if r["kind"] in kinds]


def _read(path: Path) -> list[dict]:
    """Each row with its `kind` as a `Kind`. A last line cut short by a crash mid-write is skipped (its step
    was not acked, so its groups are redelivered); blank lines are skipped; a row of a kind this version does
    not know is an error that names its line."""
    if not path.exists():
        return []
    rows = []
    lines = path.read_text().splitlines()
    for i, line in enumerate(lines):
        if not line.strip():
            continue
        try:
            row = json.loads(line)
        except json.JSONDecodeError:
            if i != len(lines) - 1:
                raise
            continue
        rows.append(_typed(row, path, i + 1))
    return rows


def _typed(row: dict, path: Path, line: int) -> dict:
    try:
        return {**row, "kind": Kind(row.get("kind", ""))}
    except ValueError:
        known = ", ".join(kind.value for kind in Kind)
        raise ValueError(f"{path}:{line}: unknown row kind {row.get('kind')!r} (known: {known}); read a log "
                         "written by another asyncrlhf version with that version") from None

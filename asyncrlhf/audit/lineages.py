"""The audit's account of each lineage of a run (each learner start, `asyncrlhf.consumed`): where it began,
the groups it trained, and how many of those the final model holds."""

from __future__ import annotations

from dataclasses import dataclass

from asyncrlhf.consumed import History, Kind


@dataclass
class LineageSummary:
    lineage: int
    from_lineage: int = 0  # the lineage it continued (0: fresh weights)
    from_version: int = 0  # the version of `from_lineage` it resumed from
    trained: int = 0  # groups it trained
    in_final_history: int = 0  # of those, the ones whose update the final model holds
    last_version: int = 0
    requeued: int = 0  # groups it enqueued again (an update or an entry lost)

    def describe(self) -> str:
        """One line of the audit's report."""
        origin = (f"from lineage {self.from_lineage} at version {self.from_version}" if self.from_lineage
                  else "from fresh weights" if self.lineage else "before lineages")
        return (f"lineage {self.lineage:<3} {origin}: trained {self.trained} groups up to version "
                f"{self.last_version}, {self.in_final_history} in the final model, {self.requeued} enqueued "
                "again (update or entry lost)")


def lineage_summaries(rows: list[dict], history: History) -> list[LineageSummary]:
    """Per lineage, oldest first, from the consumed log's `rows`; `history`: the final model's."""
    out: dict[int, LineageSummary] = {}
    for row in rows:
        lineage = row.get("lineage", 0)
        if row["kind"] == Kind.LINEAGE:
            out[lineage] = LineageSummary(lineage, row.get("from_lineage", 0), row["version"],
                                          last_version=row["version"])
            continue
        entry = out.setdefault(lineage, LineageSummary(lineage))
        if row["kind"] == Kind.TRAINED:
            entry.trained += len(row["group_ids"])
            entry.last_version = max(entry.last_version, row["version"])
            if history.contains(lineage, row["version"]):
                entry.in_final_history += len(row["group_ids"])
        elif row["kind"] == Kind.REQUEUED:
            entry.requeued += len(row["group_ids"])
    return [e for k, e in sorted(out.items()) if k or e.trained]  # lineage 0: rows from before lineages

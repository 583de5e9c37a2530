"""The audit's rules: how the groups a run enqueued ended, from the consumed log, the dead letters and what
the streams still hold (the package's docstring gives every outcome). Pure: the reading is `run.py`'s."""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterable
from dataclasses import asdict, dataclass, field

from asyncrlhf.audit.lineages import LineageSummary, lineage_summaries
from asyncrlhf.consumed import ENDINGS, Kind, ended_ids, history_of
from asyncrlhf.inbox.ids import enqueued_below, group_id
from asyncrlhf.streams import FLOW

FLOW_STREAMS = tuple(spec.name for spec, _ in FLOW)


@dataclass
class Audit:
    """The accounting of one run. `ok` is False on any loss, double training or bound violation."""

    enqueued: int
    ended: Counter[Kind] = field(default_factory=Counter)  # groups by how they ended (once)
    in_flight: dict[str, int] = field(default_factory=dict)  # stream -> groups still there
    in_flight_total: int = 0  # distinct groups in flight (a group is in one stream unless enqueued twice)
    lost: list[str] = field(default_factory=list)
    trained_twice: list[str] = field(default_factory=list)
    conflicting: list[str] = field(default_factory=list)  # ended in more than one way
    unknown: list[str] = field(default_factory=list)  # ended, but the learner never enqueued them
    dead_letter_reasons: dict[str, int] = field(default_factory=dict)  # reason (shortened) -> entries
    foreign_dead_letters: int = 0  # dead letters whose id the learner never enqueued (hand-made entries)
    finished: bool = False
    credit_bound: int | None = None
    updates_lost: list[str] = field(default_factory=list)  # trained only outside the final history
    requeued_in_flight: int = 0  # enqueued again at a learner start, still in flight (beyond the bound)
    lineages: list[LineageSummary] = field(default_factory=list)
    # continuous generation: trained groups (final history) with samples continued from tokens sampled
    # elsewhere (a hand-on or a save), those samples, and the tokens they carried over
    continued: dict[str, int] = field(default_factory=lambda: {"groups": 0, "samples": 0, "tokens": 0})
    saved_progress: dict[str, int] = field(default_factory=dict)  # saved partials: in flight / ended
    saved_unknown: list[str] = field(default_factory=list)  # progress saved for a group never enqueued

    @property
    def trained(self) -> int:
        return self.ended[Kind.TRAINED]

    @property
    def dropped(self) -> int:
        return self.ended[Kind.DROPPED]

    @property
    def filtered(self) -> int:
        return self.ended[Kind.FILTERED]

    @property
    def dead_lettered(self) -> int:
        return self.ended[Kind.DEAD_LETTERED]

    @property
    def over_bound(self) -> bool:
        return (self.credit_bound is not None
                and self.in_flight_total > self.credit_bound + self.requeued_in_flight)

    @property
    def ok(self) -> bool:
        return not (self.lost or self.trained_twice or self.conflicting or self.unknown or self.over_bound
                    or self.updates_lost or self.saved_unknown)

    def summary(self) -> dict:
        return {
            "ok": self.ok,
            "finished": self.finished,
            "enqueued": self.enqueued,
            "trained": self.trained,
            "dropped": self.dropped,
            "filtered": self.filtered,
            "dead_lettered": self.dead_lettered,
            "in_flight": self.in_flight,
            "in_flight_total": self.in_flight_total,
            "credit_bound": self.credit_bound,
            "lost": self.lost,
            "trained_twice": self.trained_twice,
            "conflicting": self.conflicting,
            "unknown": self.unknown,
            "dead_letter_reasons": self.dead_letter_reasons,
            "foreign_dead_letters": self.foreign_dead_letters,
            "updates_lost": self.updates_lost,
            "lineages": [asdict(e) for e in self.lineages],
            "continued": self.continued,
            "saved_progress": self.saved_progress,
            "saved_unknown": self.saved_unknown,
        }


def account(
    enqueued: int,
    consumed_rows: Iterable[dict],
    dead_letters: Iterable[tuple[str, str, str]],
    in_flight: dict[str, set[str]],
    *,
    finished: bool = False,
    credit_bound: int | None = None,
    enqueued_by_end: int | None = None,
) -> Audit:
    """Account for groups `g0 .. g<enqueued-1>`.

    `consumed_rows`: the learner's consumed.jsonl rows; `dead_letters`: (stream, id, reason) of each entry
    of the dead-letter stream; `in_flight`: stream name -> group ids still in that stream. A run audited
    while its learner runs goes on enqueueing and ending groups between the reads: `enqueued_by_end` is the
    feed cursor read again after the log, and a group below it but not below `enqueued` is newer than the
    audit (neither counted nor unknown)."""
    newest = max(enqueued, enqueued_by_end or 0)
    audit = Audit(enqueued=enqueued, finished=finished, credit_bound=credit_bound)
    rows = list(consumed_rows)
    history = history_of(rows)
    trained: Counter[str] = Counter()  # trainings in the final history
    outside: set[str] = set()  # trained in a lineage whose update the final model does not hold
    requeued: set[str] = set()
    ended: dict[str, set[Kind]] = {}  # id -> the ways it ended
    for row in rows:
        kind = Kind(row["kind"])
        if kind == Kind.REQUEUED:
            requeued.update(row["group_ids"])
        if kind not in ENDINGS:
            continue
        if kind == Kind.TRAINED and not history.contains(row.get("lineage", 0), row["version"]):
            outside.update(row["group_ids"])
            continue
        for gid in row["group_ids"]:
            ended.setdefault(gid, set()).add(kind)
            if kind == Kind.TRAINED:
                trained[gid] += 1
        for samples, tokens in row.get("continued", {}).values():  # only trained rows record them
            audit.continued["groups"] += 1
            audit.continued["samples"] += samples
            audit.continued["tokens"] += tokens
    audit.lineages = lineage_summaries(rows, history)
    reasons: Counter[str] = Counter()
    for stream, gid, reason in dead_letters:
        if stream not in FLOW_STREAMS or not enqueued_below(gid, newest):
            audit.foreign_dead_letters += 1
            continue
        if not enqueued_below(gid, enqueued):
            continue  # enqueued after the audit read the cursor
        reasons[_short(reason)] += 1
        if gid not in ended:  # not yet reaped by the learner (else consumed.jsonl says how it ended)
            ended[gid] = {Kind.DEAD_LETTERED}
    audit.dead_letter_reasons = dict(reasons)
    audit.trained_twice = sorted(g for g, n in trained.items() if n > 1)
    audit.unknown = sorted(g for g in ended if not enqueued_below(g, newest))
    still = {g for ids in in_flight.values() for g in ids}
    for i in range(enqueued):
        gid = group_id(i)
        kinds = ended.get(gid, set())
        if len(kinds) > 1:
            audit.conflicting.append(gid)
        elif kinds:
            audit.ended[next(iter(kinds))] += 1
        elif gid not in still:
            audit.lost.append(gid)
    open_ids = {
        stream: {g for g in ids if g not in ended and enqueued_below(g, enqueued)}
        for stream, ids in in_flight.items()
    }
    audit.in_flight = {stream: len(ids) for stream, ids in open_ids.items()}
    open_all = set().union(*open_ids.values())
    audit.in_flight_total = len(open_all)
    audit.requeued_in_flight = len(open_all & requeued)
    # Strict: a group logged as trained must end trained in the final history (or still be on its way
    # there); one dropped or dead-lettered after its update was lost is an update lost too.
    audit.updates_lost = sorted(g for g in outside if g not in trained and g not in still)

    audit.lost = [g for g in audit.lost if g not in audit.updates_lost]  # reported once, as an update lost
    return audit


def account_saved(audit: Audit, saved: Iterable[str], rows: list[dict], enqueued: int) -> Audit:
    """Add to `audit` the progress continuous generators saved that Redis still holds (`saved`: group ids):
    a group in flight, or one a crash left between its write and the forget (harmless, never read again).
    Progress saved for a group the learner never enqueued (`enqueued`: the feed cursor) is a failure."""
    ids = set(saved)
    audit.saved_unknown = sorted(g for g in ids if not enqueued_below(g, enqueued))
    ended = ended_ids(rows, history_of(rows))
    known = ids - set(audit.saved_unknown)
    audit.saved_progress = {"in_flight": len(known - ended), "ended": len(known & ended)}
    return audit


def _short(reason: str) -> str:
    return reason.split(":")[0][:80] if reason else "(no reason)"

"""`asyncrlhf audit RUN_DIR [overrides]`: did every prompt group the learner enqueued end exactly once?

The learner enqueues groups `g00000000 .. g<cursor-1>` (the cursor is the run's `FEED_CURSOR` key in
Redis) and appends every group it trains, drops as stale or counts as dead-lettered to
`<run dir>/consumed.jsonl` (fsynced before the ack). The audit joins the two with what Redis still holds:

    trained        in consumed.jsonl as `trained`, exactly once
    dropped        in consumed.jsonl as `dropped` (staleness over learner.max_staleness)
    filtered       in consumed.jsonl as `filtered` (learner.dynamic_sampling: rewards all equal, refilled)
    dead-lettered  in consumed.jsonl as `dead_lettered`, or in the dead-letter stream (with its reason) and
                   not yet counted by the learner (a dead-lettered duplicate of a group that was trained
                   ended as trained: the learner trains an id at most once)
    in flight      still an entry of the prompts, rollouts or scored stream (pending or not yet read)
    lost           none of these: a failure
    trained twice  a failure; so is a group that ended in two ways (e.g. dead-lettered and trained)
    update lost    trained, but only in lineages outside the final model's history (after the checkpoint a
                   restarted learner resumed from) and neither trained again nor in flight (dropped or
                   dead-lettered afterwards included): a failure

Trained means trained *in the final model's history* (see `asyncrlhf.consumed`): the lineage of the last
learner start, then each parent lineage up to the checkpoint version its child resumed from. A group trained
after that checkpoint is in no model; the restarted learner enqueued it again (a `requeued` row), and it
counts once it is trained in the history. The report lists every lineage: where it began, what it trained
and how much of it the final model holds.

In flight is not a loss: a running run always has some, and a finished one keeps what the learner had
enqueued beyond its last step (a resumed run trains them). Either way there may be at most the credit bound,
`(max_staleness + 1) * groups_per_step`; more is a failure. The exit code is 0 when nothing failed, 1
otherwise, 2 for a usage or config error.

Where Redis is: `redis.url` or `redis.sentinel` (the primary the sentinels name) from the config or an
override; else (the embedded Redis of `asyncrlhf up`, stopped at the end of the run) a throw-away copy of
`<run dir>/redis`, the append-only file, is loaded into an embedded server, so the audit never writes to the
run's own files and works while the run is live.
"""

from __future__ import annotations

import json
import shutil
import sys
import tempfile
from collections import Counter
from collections.abc import Iterable, Sequence
from contextlib import ExitStack
from dataclasses import dataclass, field
from pathlib import Path

from asyncrlhf.config import Config, ConfigError, load_config
from asyncrlhf.config_cli import split_config_args
from asyncrlhf.consumed import ENDINGS, History, Kind, ended_ids, history_of, read_rows
from asyncrlhf.inbox.ids import enqueued_below, group_id
from asyncrlhf.streams import (
    EVENTS,
    FEED_CURSOR,
    FLOW,
    ID_FIELD,
    PARTIALS,
    PAYLOAD_FIELD,
    RunStreams,
    connect,
)
from asyncrlhf.streams.names import group_of_identity

FLOW_STREAMS = tuple(spec.name for spec, _ in FLOW)
USAGE = """usage: asyncrlhf audit RUN_DIR [key=value ...]
       asyncrlhf audit --config CONFIG.yaml [key=value ...] [--json]

RUN_DIR is a run directory written by `asyncrlhf up` (it reads RUN_DIR/config.yaml). Without redis.url
the audit loads a copy of RUN_DIR/redis (the append-only file). Exit 0: every group accounted for."""


@dataclass
class Audit:
    """The accounting of one run. `ok` is False on any loss, double training or bound violation."""

    enqueued: int
    trained: int = 0
    dropped: int = 0
    filtered: int = 0
    dead_lettered: int = 0
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
    lineages: list[dict] = field(default_factory=list)  # per lineage: origin, groups trained, kept in history
    # continuous generation: trained groups (final history) with samples continued from tokens sampled
    # elsewhere (a hand-on or a save), those samples, and the tokens they carried over
    continued: dict[str, int] = field(default_factory=lambda: {"groups": 0, "samples": 0, "tokens": 0})
    saved_progress: dict[str, int] = field(default_factory=dict)  # saved partials: in flight / ended
    saved_unknown: list[str] = field(default_factory=list)  # progress saved for a group never enqueued

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
            "lineages": self.lineages,
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
    ended: dict[str, set[str]] = {}  # id -> the ways it ended
    for row in rows:
        kind = row["kind"]
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
    audit.lineages = _lineages(rows, history)
    reasons: Counter[str] = Counter()
    for stream, gid, reason in dead_letters:
        if stream not in FLOW_STREAMS or not enqueued_below(gid, newest):
            audit.foreign_dead_letters += 1
            continue
        if not enqueued_below(gid, enqueued):
            continue  # enqueued after the audit read the cursor
        reasons[_short(reason)] += 1
        if gid not in ended:  # not yet reaped by the learner (else consumed.jsonl says how it ended)
            ended[gid] = {"dead_lettered"}
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
            kind = next(iter(kinds))
            setattr(audit, kind, getattr(audit, kind) + 1)
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


def _lineages(rows: list[dict], history: History) -> list[dict]:
    """Per lineage, oldest first: where it began, the groups it trained, how many the final model holds."""
    out: dict[int, dict] = {}
    for row in rows:
        lineage = row.get("lineage", 0)
        if row["kind"] == Kind.LINEAGE:
            out[lineage] = {"lineage": lineage, "from_lineage": row.get("from_lineage", 0),
                            "from_version": row["version"], "trained": 0, "in_final_history": 0,
                            "last_version": row["version"], "requeued": 0}
            continue
        empty = {"lineage": lineage, "from_lineage": 0, "from_version": 0, "trained": 0,
                 "in_final_history": 0, "last_version": 0, "requeued": 0}
        entry = out.setdefault(lineage, empty)
        if row["kind"] == Kind.TRAINED:
            entry["trained"] += len(row["group_ids"])
            entry["last_version"] = max(entry["last_version"], row["version"])
            if history.contains(lineage, row["version"]):
                entry["in_final_history"] += len(row["group_ids"])
        elif row["kind"] == Kind.REQUEUED:
            entry["requeued"] += len(row["group_ids"])
    return [e for k, e in sorted(out.items()) if k or e["trained"]]  # lineage 0: rows from before lineages


def _short(reason: str) -> str:
    return reason.split(":")[0][:80] if reason else "(no reason)"


# ---------------------------------------------------------------------------------------------------------
# Reading a run


def audit_run(cfg: Config, client) -> Audit:
    """The audit of `cfg`'s run, from Redis (`client`, bytes responses) and its consumed.jsonl."""
    from asyncrlhf._proto.events_pb2 import EVENT_KIND_RUN_FINISHED, Event
    streams = RunStreams(client, cfg.run.name)
    enqueued = int(client.get(streams.key(FEED_CURSOR)) or 0)
    dead = [(d.stream, d.identity, d.reason) for d in streams.dead_letters(count=None)]
    in_flight = {
        name: {group_of_identity(f.get(ID_FIELD, b"").decode(errors="replace"))
               for _, f in client.xrange(streams.key(name))}
        for name in FLOW_STREAMS
    }
    finished = False
    for _, fields in client.xrange(streams.key(EVENTS.name)):
        event = Event()
        try:
            event.ParseFromString(fields.get(PAYLOAD_FIELD, b""))
        except Exception:  # noqa: BLE001 - a malformed event says nothing about the run
            continue
        finished = finished or event.kind == EVENT_KIND_RUN_FINISHED
    bound = (cfg.learner.max_staleness + 1) * cfg.learner.groups_per_step
    consumed = read_rows(cfg.run.path)
    enqueued_by_end = int(client.get(streams.key(FEED_CURSOR)) or 0)  # a live learner went on meanwhile
    audit = account(enqueued, consumed, dead, in_flight, finished=finished, credit_bound=bound,
                    enqueued_by_end=enqueued_by_end)
    saved = [k.decode(errors="replace") for k in client.hkeys(streams.key(PARTIALS))]
    return account_saved(audit, saved, consumed, max(enqueued, enqueued_by_end))


def connect_for_audit(cfg: Config, stack: ExitStack):
    """A client to the run's Redis: `redis.url` or the sentinels' primary, else an embedded server on a copy
    of the run's AOF."""
    from asyncrlhf.redis_server import EmbeddedRedis

    if cfg.redis.external:
        return connect(cfg.redis, retries=2)
    aof = cfg.run.path / "redis"
    if not aof.is_dir():
        raise ConfigError(
            f"no redis.url and no append-only file in {aof}: pass redis.url=redis://HOST:PORT/0 "
            "of the run's Redis"
        )
    copy = Path(stack.enter_context(tempfile.TemporaryDirectory(prefix="asyncrlhf-audit-"))) / "redis"
    shutil.copytree(aof, copy, ignore=shutil.ignore_patterns("redis.log", "*.sock"))
    server = stack.enter_context(EmbeddedRedis(copy, password=cfg.redis.password))
    return connect(cfg.redis, server.url, retries=2)


def format_audit(audit: Audit, run: str) -> str:
    lines = [f"audit of run `{run}`: {audit.enqueued} groups enqueued"]
    lines.append(f"  trained        {audit.trained}")
    lines.append(f"  dropped        {audit.dropped}  (older than learner.max_staleness)")
    if audit.filtered:
        lines.append(f"  filtered       {audit.filtered}  (no reward signal: learner.dynamic_sampling)")
    lines.append(
        f"  dead-lettered  {audit.dead_lettered}"
        + "".join(f"\n    {n} x {reason}" for reason, n in sorted(audit.dead_letter_reasons.items()))
    )
    where = ", ".join(f"{k} {v}" for k, v in audit.in_flight.items() if v) or "none"
    state = "finished: left in the streams, never trained" if audit.finished else "run not finished"
    lines.append(
        f"  in flight      {audit.in_flight_total}  ({where}; {state}; credit bound {audit.credit_bound})"
    )
    if audit.foreign_dead_letters:
        lines.append(
            f"  + {audit.foreign_dead_letters} dead letters that are not learner groups "
            "(written by hand or another producer)"
        )
    for e in audit.lineages:
        origin = (f"from lineage {e['from_lineage']} at version {e['from_version']}" if e["from_lineage"]
                  else "from fresh weights" if e["lineage"] else "before lineages")
        lines.append(f"  lineage {e['lineage']:<3} {origin}: trained {e['trained']} groups up to version "
                     f"{e['last_version']}, {e['in_final_history']} in the final model, "
                     f"{e['requeued']} enqueued again (update or entry lost)")
    c = audit.continued
    if c["samples"] or audit.saved_progress.get("in_flight") or audit.saved_progress.get("ended"):
        lines.append(f"  continued      {c['samples']} samples in {c['groups']} trained groups carried "
                     f"{c['tokens']} tokens sampled elsewhere; saved progress: "
                     f"{audit.saved_progress.get('in_flight', 0)} groups in flight, "
                     f"{audit.saved_progress.get('ended', 0)} ended (a crash between write and forget)")
    problems = [
        ("LOST (enqueued, never ended, in no stream)", audit.lost),
        ("PROGRESS SAVED FOR A GROUP NEVER ENQUEUED", audit.saved_unknown),
        ("UPDATE LOST (trained only outside the final model's history)", audit.updates_lost),
        ("TRAINED TWICE", audit.trained_twice),
        ("ENDED IN TWO WAYS", audit.conflicting),
        ("ENDED BUT NEVER ENQUEUED", audit.unknown),
    ]
    for title, ids in problems:
        if ids:
            lines.append(f"  {title}: {len(ids)}: {', '.join(ids[:10])}{' ...' if len(ids) > 10 else ''}")
    if audit.over_bound:
        lines.append(f"  OVER THE CREDIT BOUND: {audit.in_flight_total} in flight > {audit.credit_bound}")
    lines.append("OK: every group is accounted for exactly once, every trained group once in the final "
                 "model's history" if audit.ok else "FAILED")
    return "\n".join(lines)


def load_audit_config(argv: Sequence[str]) -> Config:
    """`RUN_DIR [overrides]` (RUN_DIR/config.yaml, run.dir pinned to RUN_DIR) or `--config X [overrides]`."""
    args = list(argv)
    if args and not args[0].startswith("-") and "=" not in args[0] and Path(args[0]).is_dir():
        run_dir = Path(args[0]).resolve()
        if not (run_dir / "config.yaml").is_file():
            raise ConfigError(
                f"{run_dir} has no config.yaml; use `asyncrlhf audit --config CONFIG.yaml` instead"
            )
        return load_config([run_dir / "config.yaml"], [*args[1:], f"run.dir={run_dir}"])
    files, overrides = split_config_args(args)
    if not files:
        raise ConfigError("give a run directory or --config CONFIG.yaml")
    return load_config(files, overrides)


def main(argv: Sequence[str]) -> int:
    args = list(argv)
    if not args or args[0] in ("-h", "--help"):
        print(USAGE)
        return 0 if args else 2
    as_json = "--json" in args
    args = [a for a in args if a != "--json"]
    import redis

    try:
        cfg = load_audit_config(args)
        with ExitStack() as stack:
            audit = audit_run(cfg, connect_for_audit(cfg, stack))
    except ConfigError as err:
        print(f"asyncrlhf audit: {err}", file=sys.stderr)
        return 2
    except redis.RedisError as err:
        print(
            f"asyncrlhf audit: cannot read the run's Redis: {err}; pass redis.url= of a live server",
            file=sys.stderr,
        )
        return 2
    print(json.dumps(audit.summary()) if as_json else format_audit(audit, cfg.run.name))
    return 0 if audit.ok else 1

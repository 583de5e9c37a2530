"""`asyncrlhf audit`: its arguments (a run directory or a config), its report, its exit code (0: nothing
failed, 1: a failure, 2: a usage or config error)."""

from __future__ import annotations

import json
import sys
from collections.abc import Sequence
from contextlib import ExitStack
from pathlib import Path

from asyncrlhf.audit.accounting import Audit
from asyncrlhf.audit.run import audit_run, connect_for_audit
from asyncrlhf.config import Config, ConfigError, load_config
from asyncrlhf.config_cli import split_config_args

USAGE = """usage: asyncrlhf audit RUN_DIR [key=value ...]
       asyncrlhf audit --config CONFIG.yaml [key=value ...] [--json]

RUN_DIR is a run directory written by `asyncrlhf up` (it reads RUN_DIR/config.yaml). Without redis.url
the audit loads a copy of RUN_DIR/redis (the append-only file). Exit 0: every group accounted for."""


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
    lines += [f"  {e.describe()}" for e in audit.lineages]
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

"""`asyncrlhf bench chaos [CONFIG.yaml] --seed S --kills K [key=value ...]`: random SIGKILLs in a local run.

Starts `asyncrlhf up CONFIG` with restarts on (`launch.restart=true`), then every 4-8 s (`--every A,B`)
SIGKILLs one service chosen at random by `--seed`: the learner, a generator or a reward replica, and the
embedded Redis `--redis-kills` times (default once, among the first six kills). `up` restarts each (the
learner resumes from its latest checkpoint, Redis from its append-only file). `--signal term` stops instead
(SIGTERM: a scale-down), `--signal mixed` SIGKILLs and SIGTERMs in turn. When the run ends it
prints the kills per service, the restarts, the steps reached, the verdict of `asyncrlhf audit` (groups lost,
trained twice, updates lost; dead letters by reason) and the processes a killed generator left running (its
vLLM engine's, `engine_lifetime`).
Exit 0 when the run reached `learner.total_steps`, the audit is clean and no killed generator left a process.

Defaults (overridable): configs/tiny.yaml, 2 generators, 2 reward replicas, 300 steps, a checkpoint every
7 steps, and short fault-detection timeouts so that a killed service is noticed within seconds.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import re
import signal
import subprocess
import sys
import time
from collections import Counter
from contextlib import ExitStack
from dataclasses import dataclass, field
from pathlib import Path

from asyncrlhf.consumed import Kind, rows_of
from asyncrlhf.engine_lifetime import Process, alive, descendants

DEFAULTS = [
    "generator.replicas=2", "reward.replicas=2", "launch.restart=true", "launch.evaluator=false",
    "launch.max_restarts=30", "launch.restart_window_s=300", "launch.restart_backoff_s=0.5",
    "learner.total_steps=300", "learner.checkpoint_every=7", "learner.keep_checkpoints=3",
    "redis.claim_idle_ms=2000", "redis.block_ms=200", "redis.reconnect_max_s=1",
    "generator.heartbeat_s=0.5", "generator.registry_ttl_s=6", "learner.push_timeout_s=5",
]
KINDS = ("learner", "generator", "reward")
SIGNALS = {"kill": (signal.SIGKILL,), "term": (signal.SIGTERM,), "mixed": (signal.SIGKILL, signal.SIGTERM)}


@dataclass
class Kills:
    """The kills per service, and every process a killed generator had (its vLLM engine's): none may
    outlive it."""

    counts: Counter[str] = field(default_factory=Counter)
    left: list[Process] = field(default_factory=list)


def parse(argv: list[str]) -> tuple[argparse.Namespace, list[str]]:
    parser = argparse.ArgumentParser(prog="asyncrlhf bench chaos", description=__doc__.split("\n\n")[0])
    parser.add_argument("--config", default="configs/tiny.yaml", help="the run's config (YAML)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--kills", type=int, default=10, help="SIGKILLs in all (Redis's included)")
    parser.add_argument("--redis-kills", type=int, default=1)
    parser.add_argument("--every", default="4,8", help="seconds between kills: MIN,MAX")
    parser.add_argument("--root", default="runs", help="the run goes to ROOT/chaos-<seed>")
    parser.add_argument("--timeout", type=float, default=3600.0, help="give up on the run after this long")
    parser.add_argument("--kinds", default=",".join(KINDS),
                        help=f"the services to kill, comma-separated from {', '.join(KINDS)} (Redis: "
                        "--redis-kills)")
    parser.add_argument("--signal", choices=tuple(SIGNALS), default="kill",
                        help="SIGKILL (no warning), SIGTERM (a scale-down: the service stops cleanly), or "
                        "the two in turn")
    parser.add_argument("--tokens", action="store_true",
                        help="continuous generators: count the tokens sampled twice (asyncrlhf.bench."
                        "regenerated): each generator's counters are read just before it is killed")
    argv = [f"--config={a}" if a.endswith((".yaml", ".yml")) and "=" not in a else a for a in argv]
    args, overrides = parser.parse_known_args(argv)
    bad = [o for o in overrides if "=" not in o]
    if bad:
        parser.error(f"unknown arguments {bad}: overrides are key=value")
    args.kinds = tuple(k.strip() for k in args.kinds.split(",") if k.strip())
    if not args.kinds or set(args.kinds) - set(KINDS):
        parser.error(f"--kinds: choose from {', '.join(KINDS)}")
    return args, overrides


def pids(pattern: str) -> list[int]:
    found = subprocess.run(["pgrep", "-f", pattern], capture_output=True, text=True)
    return [int(p) for p in found.stdout.split() if int(p) != os.getpid()]


def targets(run_name: str, log_path: Path, kind: str) -> list[int]:
    """The live processes of `kind` in this run (`redis`: its embedded server, found by the port that `up`
    printed: redis-server rewrites its command line to `redis-server HOST:PORT`)."""
    if kind == "redis":
        found = re.search(r"Redis redis://[^ ]*:(\d+)/", log_path.read_text(errors="replace"))
        return pids(f"redis-server [^ ]*:{found.group(1)}$") if found else []
    return pids(f"services\\.{kind} .*run\\.name={run_name}( |$)")


def trained_steps(run_dir: Path) -> int:
    return len(rows_of(run_dir, Kind.TRAINED))


def main(argv: list[str]) -> int:
    from asyncrlhf.bench.regenerated import TokenLedger, read_before_kill
    from asyncrlhf.config import load_config

    args, overrides = parse(list(argv))
    g = load_config([args.config], [*DEFAULTS, *overrides]).generator
    capacity = g.max_running_samples or g.batch_prompts * g.samples_per_prompt
    ledger = TokenLedger()
    signals = SIGNALS[args.signal]
    low, high = (float(x) for x in args.every.split(","))
    rng = random.Random(args.seed)
    run_name = f"chaos-{args.seed}"
    run_dir = Path(args.root).resolve() / run_name
    cmd = [sys.executable, "-m", "asyncrlhf.cli", "up", args.config, *DEFAULTS, *overrides,
           f"run.name={run_name}", f"run.dir={run_dir}"]
    if run_dir.exists() and any(run_dir.iterdir()):
        print(f"asyncrlhf bench chaos: {run_dir} is not empty (a previous run would be resumed): delete "
              "it or pass another --root", file=sys.stderr)
        return 2
    run_dir.mkdir(parents=True, exist_ok=True)
    log_path = run_dir.parent / f"{run_name}.up.log"
    early = max(min(args.kills, 6), args.redis_kills)  # Redis dies early, so it happens before the run ends
    redis_at = set(rng.sample(range(early), min(args.redis_kills, args.kills)))
    kills = Kills()
    started = time.monotonic()
    with log_path.open("w") as log:
        up = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
    print(f"bench chaos: seed {args.seed}, {args.kills} kills every {low:g}-{high:g} s; run in {run_dir}, "
          f"`up` log {log_path}", flush=True)
    try:
        while trained_steps(run_dir) < 1 and up.poll() is None:  # the pipeline is up before the first kill
            time.sleep(0.5)
        for i in range(args.kills):
            deadline = time.monotonic() + rng.uniform(low, high)
            while time.monotonic() < deadline and up.poll() is None:
                time.sleep(0.2)
            if up.poll() is not None:
                break
            kind = "redis" if i in redis_at else rng.choice(args.kinds)
            live = targets(run_name, log_path, kind)
            if not live:  # it is restarting right now
                continue
            victim = rng.choice(sorted(live))
            sig = signals[sum(kills.counts.values()) % len(signals)]
            if kind == "generator":
                kills.left += descendants(victim)
            reading = (read_before_kill(victim, capacity)
                       if args.tokens and kind == "generator" and sig == signal.SIGKILL else None)
            try:
                os.kill(victim, sig)
            except ProcessLookupError:
                continue
            if reading is not None:
                ledger.kills.append(reading)
            elif args.tokens and kind == "generator" and sig == signal.SIGKILL:
                ledger.unread += 1
            kills.counts[kind] += 1
            print(f"  {time.monotonic() - started:7.1f} s  {sig.name} {kind} (pid {victim})", flush=True)
        code = up.wait(timeout=max(1.0, args.timeout - (time.monotonic() - started)))
    except (subprocess.TimeoutExpired, KeyboardInterrupt):
        os.killpg(up.pid, signal.SIGTERM)
        code = up.wait()
    return report(args, run_dir, log_path, kills, code, time.monotonic() - started, ledger)


def report(args, run_dir: Path, log_path: Path, kills: Kills, code: int, seconds: float, ledger) -> int:
    from asyncrlhf.audit import audit_run, connect_for_audit, load_audit_config
    from asyncrlhf.training.checkpoint import latest_version

    cfg = load_audit_config([str(run_dir)])
    summary_path = run_dir / "up_summary.json"
    summary = json.loads(summary_path.read_text()) if summary_path.exists() else {}
    restarts = {name: s["restarts"] for name, s in summary.get("services", {}).items() if s["restarts"]}
    version = latest_version(cfg)
    steps = (version or 1) - 1
    outlived = alive(kills.left)
    with ExitStack() as stack:
        client = connect_for_audit(cfg, stack)
        audit = audit_run(cfg, client)
        tokens = token_figures(cfg, client, ledger) if args.tokens else {}
    result = {
        "seed": args.seed, "up_exit": code, "seconds": round(seconds, 1), "kills": dict(kills.counts),
        "restarts": restarts, "redis_restarts": _count(log_path, "Redis exited"),
        "steps": steps, "total_steps": cfg.learner.total_steps, "lineages": len(audit.lineages),
        "audit_ok": audit.ok, "lost": len(audit.lost), "trained_twice": len(audit.trained_twice),
        "updates_lost": len(audit.updates_lost), "in_flight": audit.in_flight_total,
        "continued": audit.continued, "dead_lettered": audit.dead_lettered,
        "dead_letter_reasons": audit.dead_letter_reasons, "outlived_generators": [pid for pid, _ in outlived],
        **tokens,
    }
    print(f"bench chaos seed {args.seed}: `up` exit {code} after {seconds:.0f} s; steps {steps}/"
          f"{cfg.learner.total_steps}; kills {dict(kills.counts)}; restarts {restarts} (Redis "
          f"{result['redis_restarts']}); {len(audit.lineages)} lineages")
    print(f"  audit: {'OK' if audit.ok else 'FAILED'}: lost {len(audit.lost)}, trained twice "
          f"{len(audit.trained_twice)}, updates lost {len(audit.updates_lost)}, in flight "
          f"{audit.in_flight_total}, dead-lettered {audit.dead_lettered} {audit.dead_letter_reasons}")
    if outlived:
        print(f"  processes of killed generators still running: {[pid for pid, _ in outlived]}")
    if tokens:
        print(f"  tokens: {tokens['tokens_sampled']} sampled, {tokens['tokens_written']} written, "
              f"{tokens['tokens_in_flight_at_end']} in flight at the end: {tokens['tokens_regenerated']} "
              f"sampled twice, {tokens['regenerated_per_sample_in_flight']:.1f} per sample in flight at a "
              f"kill (bound: save_every_tokens {tokens['bound_per_sample']}; {tokens['unread_kills']} kills "
              "unread); continued samples "
              f"{audit.continued['samples']}")
    print(json.dumps(result), flush=True)
    return 0 if code == 0 and steps >= cfg.learner.total_steps and audit.ok and not outlived else 1


def _count(path: Path, text: str) -> int:
    return path.read_text(errors="replace").count(text) if path.exists() else 0


def token_figures(cfg, client, ledger) -> dict:
    from asyncrlhf.bench.regenerated import add_stopped, in_flight_tokens
    from asyncrlhf.consumed import ended_ids, history_of, read_rows

    add_stopped(ledger, cfg.run.path / "logs")
    rows = read_rows(cfg.run.path)
    ledger.in_flight_at_end = in_flight_tokens(client, cfg.run.name, ended_ids(rows, history_of(rows)))
    return ledger.summary(cfg.generator.save_every_tokens)

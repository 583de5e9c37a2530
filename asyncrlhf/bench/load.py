"""`asyncrlhf bench load`: backpressure under load. Many generators and reward replicas (4 and 3 by default)
on the tiny model, run for a while; then the learner is stalled (SIGSTOP): production must stop at the
credit bound, `(max_staleness + 1) * groups_per_step` groups in flight, while queue lengths and every
process's resident memory stay flat; then it is resumed (SIGCONT) and must go on with nothing lost
(`asyncrlhf audit`).

Services are the launcher's (`asyncrlhf.launcher.plan`), one process each, on an embedded Redis. Every
`--sample-s` seconds it records the groups enqueued, generated, scored and finished (from Redis), the stream
lengths, and each process's VmRSS (/proc/<pid>/status). It prints one line per phase and the verdicts;
exit 0 when every check holds.
"""

from __future__ import annotations

import argparse
import signal
import tempfile
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path

from asyncrlhf.config import load_config
from asyncrlhf.launcher import plan
from asyncrlhf.processes import Service
from asyncrlhf.redis_server import EmbeddedRedis
from asyncrlhf.streams import (
    FEED_CURSOR,
    FLOW,
    GENERATOR_GROUP,
    LEARNER_FINISHED,
    PROMPTS,
    REWARD_GROUP,
    ROLLOUTS,
    RunStreams,
    connect,
)

RSS_FLAT_MB = 50.0  # most growth of one process's RSS over the stall that still counts as flat


@dataclass
class Sample:
    at: float
    enqueued: int
    generated: int
    scored: int
    finished: int
    queues: dict[str, int]
    rss_mb: dict[str, float]


@dataclass
class Phase:
    name: str
    samples: list[Sample] = field(default_factory=list)

    def delta(self, attr: str) -> int:
        return getattr(self.samples[-1], attr) - getattr(self.samples[0], attr) if self.samples else 0

    @property
    def seconds(self) -> float:
        return self.samples[-1].at - self.samples[0].at if len(self.samples) > 1 else 0.0


def rss_mb(pid: int) -> float:
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024
    except OSError:
        pass
    return float("nan")


def sample(client, run: str, services: Sequence[Service]) -> Sample:
    streams = RunStreams(client, run)
    return Sample(
        at=time.monotonic(),
        enqueued=int(client.get(streams.key(FEED_CURSOR)) or 0),
        generated=client.zcard(streams.seen_key(PROMPTS, GENERATOR_GROUP)),
        scored=client.zcard(streams.seen_key(ROLLOUTS, REWARD_GROUP)),
        finished=int(client.get(streams.key(LEARNER_FINISHED)) or 0),
        queues={spec.name: client.xlen(streams.key(spec.name)) for spec, _ in FLOW},
        rss_mb={s.name: rss_mb(s.proc.pid) for s in services if s.proc},
    )


def record(
    phase: Phase, seconds: float, every: float, client, run: str, services: Sequence[Service]
) -> Phase:
    end = time.monotonic() + seconds
    while True:
        dead = [s.name for s in services if s.poll() is not None]
        if dead:
            raise RuntimeError(
                f"{', '.join(dead)} exited during `{phase.name}`; see {services[0].log_path.parent}"
            )
        phase.samples.append(sample(client, run, services))
        if time.monotonic() >= end:
            return phase
        time.sleep(every)


def describe(phase: Phase) -> str:
    s = phase.samples[-1]
    rate = lambda attr: phase.delta(attr) / phase.seconds if phase.seconds else 0.0  # noqa: E731
    queues = " ".join(f"{k}={v}" for k, v in s.queues.items())
    return (
        f"{phase.name:>8}: {phase.seconds:6.0f}s  enqueued +{phase.delta('enqueued')} "
        f"generated +{phase.delta('generated')} ({rate('generated'):.2f}/s) scored +{phase.delta('scored')} "
        f"trained/finished +{phase.delta('finished')} ({rate('finished'):.2f}/s)  in flight "
        f"{s.enqueued - s.finished}  queues {queues}"
    )


def rss_growth(phase: Phase) -> dict[str, float]:
    first, last = phase.samples[0].rss_mb, phase.samples[-1].rss_mb
    return {name: last[name] - first[name] for name in first}


def parse_args(argv: Sequence[str]) -> tuple[argparse.Namespace, list[str]]:
    parser = argparse.ArgumentParser(prog="asyncrlhf bench load", description=__doc__.split("\n\n")[0])
    parser.add_argument("--config", default="configs/tiny.yaml")
    parser.add_argument("--generators", type=int, default=4)
    parser.add_argument("--rewards", type=int, default=3)
    parser.add_argument("--run-s", type=float, default=180.0, help="Seconds of normal running first.")
    parser.add_argument("--stall-s", type=float, default=60.0, help="Seconds the learner stays stopped.")
    parser.add_argument("--after-s", type=float, default=60.0, help="Seconds of running after SIGCONT.")
    parser.add_argument("--sample-s", type=float, default=2.0)
    parser.add_argument("--dir", default=None, help="Run directory (default: a temporary one).")
    return parser.parse_known_args(list(argv))


def main(argv: Sequence[str]) -> int:
    args, overrides = parse_args(argv)
    run_dir = Path(args.dir or tempfile.mkdtemp(prefix="asyncrlhf-load-")).resolve()
    overrides = [
        f"run.name=load-{int(time.time())}",
        f"run.dir={run_dir}",
        f"generator.replicas={args.generators}",
        f"reward.replicas={args.rewards}",
        "launch.evaluator=false",
        "learner.total_steps=1000000",
        "learner.checkpoint_every=1000000",
        *overrides,
    ]
    cfg = load_config([args.config], overrides)
    bound = (cfg.learner.max_staleness + 1) * cfg.learner.groups_per_step
    with EmbeddedRedis(run_dir / "redis") as server:
        client = connect(cfg.redis, server.url, retries=3)
        services = plan(cfg, [args.config], overrides, server.url)
        learner = next(s for s in services if s.kind == "learner")
        print(
            f"bench load: {args.generators} generators, {args.rewards} reward replicas, learner; bound "
            f"{bound} groups; logs in {run_dir / 'logs'}",
            flush=True,
        )
        for svc in services:
            svc.start()
        try:
            return _measure(args, cfg, client, services, learner, bound)
        finally:
            for svc in services:
                svc.signal(signal.SIGCONT)
                svc.signal(signal.SIGTERM)
            for svc in services:
                svc.wait(60)


def _measure(args, cfg, client, services, learner, bound) -> int:
    from asyncrlhf.audit import audit_run, format_audit

    key = RunStreams(client, cfg.run.name).key(LEARNER_FINISHED)
    deadline = time.monotonic() + 600
    while int(client.get(key) or 0) == 0:  # start-up: import, models, DeepSpeed, first push
        if time.monotonic() > deadline or learner.proc.poll() is not None:
            raise RuntimeError(f"the learner did not train within 600 s; see {learner.log_path}")
        time.sleep(1)
    running = record(Phase("running"), args.run_s, args.sample_s, client, cfg.run.name, services)
    learner.signal(signal.SIGSTOP)
    stalled = record(Phase("stalled"), args.stall_s, args.sample_s, client, cfg.run.name, services)
    learner.signal(signal.SIGCONT)
    resumed = record(Phase("resumed"), args.after_s, args.sample_s, client, cfg.run.name, services)
    for phase in (running, stalled, resumed):
        print(describe(phase))
    settled = Phase("settled", stalled.samples[len(stalled.samples) // 2 :])  # the stall's second half
    running_growth = rss_growth(Phase("tail", running.samples[len(running.samples) // 2 :]))
    print("RSS MB growth over the second half of running: "
          + ", ".join(f"{n} {g:+.1f}" for n, g in running_growth.items()))
    growth = rss_growth(stalled)
    print(
        "RSS MB at stall start -> end (growth): "
        + ", ".join(
            f"{n} {stalled.samples[0].rss_mb[n]:.0f}->{stalled.samples[-1].rss_mb[n]:.0f} ({g:+.1f})"
            for n, g in growth.items()
        )
    )
    in_flight = max(s.enqueued - s.finished for s in stalled.samples)
    queued = max(sum(s.queues.values()) for s in stalled.samples)
    late_generated = settled.delta("generated")
    queues_then, queues_now = settled.samples[0].queues, settled.samples[-1].queues
    most_growth = max(growth.values())
    checks = {
        f"no group enqueued while stalled (+{stalled.delta('enqueued')})": stalled.delta("enqueued") == 0,
        f"in flight <= credit bound ({in_flight} <= {bound})": in_flight <= bound,
        f"queued entries <= credit bound ({queued} <= {bound})": queued <= bound,
        f"generation stopped in the stall's second half (+{late_generated})": late_generated == 0,
        f"queues flat in the stall's second half ({queues_then} -> {queues_now})": queues_then == queues_now,
        f"every process's RSS grew < {RSS_FLAT_MB:.0f} MB while stalled (max {most_growth:+.1f})":
            most_growth < RSS_FLAT_MB,
        f"training resumed (+{resumed.delta('finished')} groups finished)": resumed.delta("finished") > 0,
    }
    learner.signal(signal.SIGTERM)
    learner.proc.wait(120)
    audit = audit_run(cfg, client)
    print(format_audit(audit, cfg.run.name))
    checks["audit: nothing lost, nothing trained twice"] = audit.ok
    for name, ok in checks.items():
        print(f"  {'ok  ' if ok else 'FAIL'} {name}")
    return 0 if all(checks.values()) else 1

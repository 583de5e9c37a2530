"""Stalls name their cause: one `asyncrlhf up` run on configs/tiny.yaml (two generators, two reward
replicas) in which each service is frozen in turn with SIGSTOP (alive, sockets open, no progress: the silent
case a SIGKILL test never sees): the learner, one generator, all generators, one reward replica, Redis. Each
must be named by `up` within the bound, and the learner must step again after SIGCONT; after Redis resumes,
the stall stays Redis's until the learner steps (no other hop is blamed while the backlog drains).

The bound: `launch.stall_after_s` (the learner's last step came before the freeze, so a stall it causes is
judged that long after at most), plus the time to see it: one progress period, a 2 s scrape per frozen
service and a 1 s Redis probe. The messages and their delays are printed and appended to
$TMPDIR/asyncrlhf_stalls.txt, for the record of what an operator sees.
"""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path

import pytest

from asyncrlhf.bench.chaos import targets, trained_steps

pytestmark = pytest.mark.e2e
ROOT = Path(__file__).resolve().parents[2]
STALL_AFTER_S = 5.0
BOUND_S = STALL_AFTER_S + 10.0
RECOVER_S = 120.0
OVERRIDES = [
    "generator.replicas=2", "reward.replicas=2", "launch.evaluator=false", "learner.total_steps=100000",
    "learner.checkpoint_every=1000", f"launch.stall_after_s={STALL_AFTER_S}", "redis.block_ms=200",
    "generator.heartbeat_s=0.5", "generator.registry_ttl_s=6", "learner.push_timeout_s=10",
    "generator.device=cpu",
]


class Up:
    """`asyncrlhf up` in its own process group, its output in a file read as it grows, each line stamped
    with the time it was first seen."""

    def __init__(self, tmp: Path):
        self.name, self.dir, self.log = "stalls", tmp / "stalls", tmp / "up.log"
        cmd = [sys.executable, "-m", "asyncrlhf.cli", "up", "configs/tiny.yaml", *OVERRIDES,
               f"run.name={self.name}", f"run.dir={self.dir}"]
        with self.log.open("w") as out:
            self.proc = subprocess.Popen(cmd, cwd=ROOT, stdout=out, stderr=subprocess.STDOUT,
                                         env={**os.environ, "PYTHONPATH": str(ROOT)}, start_new_session=True)
        self.lines: list[tuple[float, str]] = []
        self._read = 0

    def poll_lines(self) -> None:
        text = self.log.read_text(errors="replace")
        complete = text[:text.rfind("\n") + 1]
        now = time.monotonic()
        self.lines += [(now, line) for line in complete[self._read:].splitlines()]
        self._read = len(complete)

    def wait_line(self, matches: Callable[[str], bool], since: float, timeout_s: float) -> tuple[float, str]:
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            self.poll_lines()
            found = [(t, line) for t, line in self.lines if t >= since and matches(line)]
            if found:
                return found[0]
            assert self.proc.poll() is None, f"`up` exited with {self.proc.returncode}:\n{self.tail()}"
            time.sleep(0.2)
        raise AssertionError(f"nothing named it within {timeout_s:.0f} s; `up` said:\n{self.tail()}")

    def wait_steps(self, more: int, timeout_s: float) -> float:
        """Seconds until the learner trained `more` steps beyond now."""
        started, target = time.monotonic(), trained_steps(self.dir) + more
        while trained_steps(self.dir) < target:
            assert self.proc.poll() is None, f"`up` exited with {self.proc.returncode}:\n{self.tail()}"
            assert time.monotonic() - started < timeout_s, f"no step in {timeout_s:.0f} s:\n{self.tail()}"
            time.sleep(0.2)
        return time.monotonic() - started

    def pids(self, kind: str) -> list[int]:
        return sorted(targets(self.name, self.log, kind))

    def tail(self, n: int = 40) -> str:
        return "\n".join(self.log.read_text(errors="replace").splitlines()[-n:])

    def stop(self) -> None:
        for kind in ("redis", "learner", "generator", "reward"):  # nothing may stay frozen
            for pid in self.pids(kind):
                os.kill(pid, signal.SIGCONT)
        if self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGTERM)
            try:
                self.proc.wait(60)
            except subprocess.TimeoutExpired:
                os.killpg(self.proc.pid, signal.SIGKILL)
                self.proc.wait()


def process_name(pid: int) -> str:
    """The launcher's name of a service process: its log file (`up` points its stdout there)."""
    return Path(os.readlink(f"/proc/{pid}/fd/1")).stem


def names_replica(name: str, pid: int) -> Callable[[str], bool]:
    """A line of `up` that names the replica: by the launcher's name, or by its Redis id (which holds its
    pid: `gen-<host>-<pid>-<hex>`, `reward-<host>-<pid>`)."""
    by_id = re.compile(rf"-{pid}(-|\b)")
    return lambda line: line.startswith("asyncrlhf up: ") and (
        f"{name} alive but not answering" in line or ("stalled at" in line and bool(by_id.search(line))))


def freeze(up: Up, what: str, pids: list[int], matches: Callable[[str], bool],
           record: list[str]) -> list[str]:
    """SIGSTOP `pids`, wait for `up` to name it, SIGCONT, and wait for the learner to step again; the stalls
    `up` said from the SIGCONT until then."""
    up.wait_steps(1, RECOVER_S)  # a step just happened: the freeze starts from a live run
    up.poll_lines()  # what was said before the freeze is stamped before it
    frozen_at = time.monotonic()
    for pid in pids:
        os.kill(pid, signal.SIGSTOP)
    try:
        seen_at, line = up.wait_line(matches, frozen_at, BOUND_S + 30)
    finally:
        for pid in pids:
            os.kill(pid, signal.SIGCONT)
    thawed_at = time.monotonic()
    recovered = up.wait_steps(1, RECOVER_S)
    delay = seen_at - frozen_at
    summary = f"{what}: named after {delay:.1f} s, stepped again {recovered:.1f} s after SIGCONT: {line}"
    record.append(summary)
    record += [f"    +{t - frozen_at:.1f} s {said}" for t, said in up.lines
               if frozen_at <= t <= thawed_at + recovered and said.startswith("asyncrlhf up: ")]
    assert delay <= BOUND_S, summary
    return [said for t, said in up.lines if thawed_at <= t <= thawed_at + recovered and "stalled at" in said]


def test_each_frozen_service_is_named_within_the_bound_and_the_run_recovers(tmp_path):
    """Over 60 s because the one run freezes five services in turn: each freeze waits to be named (up to
    BOUND_S), then for the learner's next step after SIGCONT, after the stack's start."""
    up, record = Up(tmp_path), []
    started = time.monotonic()
    try:
        up.wait_steps(2, 600)
        learner = up.pids("learner")
        assert len(learner) == 1, up.tail()
        freeze(up, "learner", learner, lambda line: "stalled at learner: learner not stepping" in line
               and "metrics endpoint does not answer" in line, record)
        generators = up.pids("generator")
        assert len(generators) == 2, up.tail()
        one = generators[0]
        freeze(up, f"one generator ({process_name(one)})", [one], names_replica(process_name(one), one),
               record)
        freeze(up, "all generators", generators,
               lambda line: "stalled at" in line and "generators alive 0 of 2" in line, record)
        rewards = up.pids("reward")
        assert len(rewards) == 2, up.tail()
        freeze(up, f"one reward replica ({process_name(rewards[0])})", rewards[:1],
               names_replica(process_name(rewards[0]), rewards[0]), record)
        draining = freeze(up, "Redis", up.pids("redis"),
                          lambda line: "stalled at redis: Redis not answering" in line, record)
        # resumed: until the learner steps, the stall stays Redis's, never another hop's while it drains
        assert all(line.startswith("asyncrlhf up: stalled at redis: ") for line in draining), draining
    finally:
        up.stop()
        record.append(f"the whole test took {time.monotonic() - started:.0f} s; the learner's log said:")
        learner_log = up.dir / "logs" / "learner.log"
        record += [f"    {line}" for line in learner_log.read_text(errors="replace").splitlines()
                   if "stalled at" in line or "stall over" in line]
        report = "\n".join(record)
        print(report)
        with (Path(os.environ.get("TMPDIR", "/tmp")) / "asyncrlhf_stalls.txt").open("a") as f:
            f.write(report + "\n\n")

"""`asyncrlhf audit` as a user runs it: on a run directory whose embedded Redis has stopped (it loads a copy
of the append-only file and leaves the run's files alone), on a live Redis, and its exit codes."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from asyncrlhf._proto.events_pb2 import EVENT_KIND_RUN_FINISHED, Event
from asyncrlhf._proto.rollout_pb2 import RolloutGroup
from asyncrlhf.config import load_config
from asyncrlhf.consumed import log_path
from asyncrlhf.redis_server import EmbeddedRedis
from asyncrlhf.streams import EVENTS, FEED_CURSOR, SCORED, RunStreams, connect

pytestmark = pytest.mark.integration
ROOT = Path(__file__).resolve().parents[3]


def audit(*args: str) -> tuple[int, str]:
    done = subprocess.run(
        [sys.executable, "-m", "asyncrlhf.cli", "audit", *args],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=120,
        env={**os.environ, "PYTHONPATH": str(ROOT)},
    )
    return done.returncode, done.stdout + done.stderr


def fake_run(run_dir: Path, server: EmbeddedRedis, trained: list[str], in_scored: list[str], finished: bool):
    """A run as the learner leaves it: 4 groups enqueued, some trained (consumed.jsonl), some still in
    `scored`, optionally the run-finished event."""
    cfg = load_config(["configs/tiny.yaml"], [f"run.dir={run_dir}", "run.name=audit-cli"])
    run_dir.mkdir(parents=True, exist_ok=True)
    (run_dir / "config.yaml").write_text(cfg.to_yaml())  # as `asyncrlhf up` writes it (no redis.url)
    streams = RunStreams(connect(cfg.redis, server.url), cfg.run.name)
    streams.client.set(streams.key(FEED_CURSOR), 4)
    streams.producer(SCORED).add_many([RolloutGroup(group_id=g) for g in in_scored])
    if finished:
        streams.producer(EVENTS).add(Event(event_id="e1", kind=EVENT_KIND_RUN_FINISHED))
    row = {"kind": "trained", "version": 2, "group_ids": trained, "at": 0.0, "staleness": [0] * len(trained)}
    log_path(run_dir).write_text(json.dumps(row) + "\n")


def test_a_finished_run_is_audited_from_a_copy_of_its_append_only_file(tmp_path):
    run_dir = tmp_path / "run"
    with EmbeddedRedis(run_dir / "redis") as server:
        fake_run(run_dir, server, ["g00000000", "g00000001"], ["g00000002", "g00000003"], finished=True)
    before = {p: p.stat().st_mtime_ns for p in (run_dir / "redis").rglob("*")}
    code, out = audit(str(run_dir))
    assert code == 0, out
    assert "trained        2" in out and "in flight      2" in out and "finished: left in the streams" in out
    assert {p: p.stat().st_mtime_ns for p in (run_dir / "redis").rglob("*")} == before  # the run is untouched


def test_a_lost_group_fails_the_audit_of_a_live_run(tmp_path):
    run_dir = tmp_path / "run"
    with EmbeddedRedis() as server:
        fake_run(run_dir, server, ["g00000000", "g00000001"], ["g00000003"], finished=False)  # g2 is nowhere
        code, out = audit(str(run_dir), f"redis.url={server.url}", "--json")
    assert code == 1, out
    report = json.loads(out)
    assert report["lost"] == ["g00000002"] and not report["finished"] and not report["ok"]


def test_usage_errors_exit_2_and_say_what_to_do(tmp_path):
    code, out = audit(str(tmp_path))
    assert code == 2 and "has no config.yaml" in out
    (tmp_path / "config.yaml").write_text("run: {name: x}\n")
    code, out = audit(str(tmp_path))
    assert code == 2 and "no append-only file" in out and "redis.url=" in out
    code, out = audit(str(tmp_path), "redis.urll=redis://x")
    assert code == 2 and "did you mean `redis.url`" in out

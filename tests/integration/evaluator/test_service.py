"""The evaluator service on the tiny model and a real Redis: the initial policy, then a checkpoint announced
on the events stream, then RUN_FINISHED (final checkpoint evaluated, clean exit)."""

import json
import re
import threading
import time
import uuid

import httpx
import pytest

from asyncrlhf import metrics as names
from asyncrlhf._proto.events_pb2 import EVENT_KIND_CHECKPOINT_SAVED, EVENT_KIND_RUN_FINISHED, Event
from asyncrlhf.config import load_config
from asyncrlhf.streams import EVENTS, RunStreams
from asyncrlhf.training.checkpoint import step_dir
from services.evaluator.loop import Evaluator
from tests.integration.evaluator.checkpoints import write_checkpoint

pytestmark = pytest.mark.integration

KEYS = {
    "version",
    "step",
    "checkpoint",
    "time",
    "elapsed_s",
    "gold_reward",
    "win_rate",
    "kl",
    "perplexity",
    "n_prompts",
}


def results(run_dir):
    path = run_dir / "eval" / "results.jsonl"
    return [json.loads(line) for line in path.read_text().splitlines()] if path.exists() else []


def wait_for(predicate, timeout=120.0):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if predicate():
            return
        time.sleep(0.2)
    raise AssertionError("timed out")


def event(kind, version, path=""):
    return Event(
        event_id=uuid.uuid4().hex,
        kind=kind,
        policy_version=version,
        timestamp=time.time(),
        source="test",
        checkpoint_path=path,
    )


def test_follows_checkpoint_events_and_exits_after_run_finished(tmp_path, redis_url, run_name, redis_client):
    cfg = load_config(
        ["configs/tiny.yaml"],
        [
            f"run.name={run_name}",
            f"run.dir={tmp_path}",
            f"redis.url={redis_url}",
            "redis.block_ms=100",
            "evaluator.num_prompts=4",
            "evaluator.max_new_tokens=8",
            "evaluator.device=cpu",
            "evaluator.every_n=2",
            "run.trackers=[tensorboard]",
        ],
    )
    stop = threading.Event()
    evaluator = Evaluator(cfg, stop).start()
    outcome = {}
    thread = threading.Thread(target=lambda: outcome.setdefault("rc", evaluator.run()), daemon=True)
    thread.start()
    try:
        wait_for(lambda: len(results(tmp_path)) == 1)
        initial = results(tmp_path)[0]
        assert set(initial) == KEYS
        assert (initial["version"], initial["step"], initial["checkpoint"]) == (1, 0, "initial")
        assert (initial["win_rate"], initial["kl"], initial["elapsed_s"]) == (0.5, 0.0, 0.0)
        assert (tmp_path / "eval" / "references.jsonl").is_file()

        events = RunStreams.from_config(cfg, redis_client).producer(EVENTS)
        events.add(event(EVENT_KIND_CHECKPOINT_SAVED, 3, str(write_checkpoint(tmp_path, 3))))  # 1st: skipped
        events.add(
            event(EVENT_KIND_CHECKPOINT_SAVED, 5, str(write_checkpoint(tmp_path, 5, scale=2.0)))
        )  # 2nd
        wait_for(lambda: len(results(tmp_path)) == 2)
        row = results(tmp_path)[1]
        assert (row["version"], row["step"]) == (5, 4)
        assert row["checkpoint"] == str(step_dir(tmp_path, 5)) and row["kl"] != 0.0 and row["elapsed_s"] > 0

        metrics = httpx.get(f"{evaluator.http.url}/metrics").text
        assert f"{names.EVALUATOR_VERSION} 5.0" in metrics
        assert float(
            re.search(rf"^{names.EVALUATOR_KL} (\S+)$", metrics, re.MULTILINE).group(1)
        ) == pytest.approx(row["kl"])
        assert f"{names.EVALUATOR_EVALUATIONS_TOTAL} 2.0" in metrics
        assert httpx.get(f"{evaluator.http.url}/readyz").status_code == 200

        final = write_checkpoint(tmp_path, 6, scale=0.5)  # saved, then the run finishes: evaluated although
        events.add(event(EVENT_KIND_CHECKPOINT_SAVED, 6, str(final)))  # every_n=2 skips its event
        events.add(event(EVENT_KIND_RUN_FINISHED, 6))
        thread.join(timeout=120)
        assert not thread.is_alive() and outcome["rc"] == 0
        assert [r["version"] for r in results(tmp_path)] == [1, 5, 6]
        report = (tmp_path / "report.md").read_text()
        assert "| 6 | 5 |" in report and (tmp_path / "plots" / "overview.png").stat().st_size > 1000
        from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

        tracked = EventAccumulator(str(tmp_path / "tensorboard" / "evaluator"), size_guidance={"scalars": 0})
        tracked.Reload()
        for key in ("gold_reward", "win_rate", "kl"):
            logged = [(e.step, e.value) for e in tracked.Scalars(f"eval/{key}")]
            assert logged == [(r["step"], pytest.approx(r[key])) for r in results(tmp_path)], key
    finally:
        stop.set()
        thread.join(timeout=30)


def test_a_restarted_evaluator_does_not_redo_versions(tmp_path, redis_url, run_name):
    cfg = load_config(
        ["configs/tiny.yaml"],
        [
            f"run.name={run_name}",
            f"run.dir={tmp_path}",
            f"redis.url={redis_url}",
            "evaluator.num_prompts=2",
            "evaluator.max_new_tokens=4",
            "evaluator.device=cpu",
        ],
    )
    first = Evaluator(cfg).start()
    first.evaluate_initial()
    first.evaluate_checkpoint(str(write_checkpoint(tmp_path, 2)), 2)
    first.http.stop()
    second = Evaluator(cfg).start()
    second.evaluate_initial()
    second.evaluate_checkpoint(str(step_dir(tmp_path, 2)), 2)
    second.evaluate_checkpoint(str(step_dir(tmp_path, 99)), 99)  # pruned: skipped
    second.http.stop()
    assert [r["version"] for r in results(tmp_path)] == [1, 2]

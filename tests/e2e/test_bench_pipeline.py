"""`asyncrlhf bench pipeline --json`, the real entry point on the tiny model: the in-process baseline and a
synchronous service run train the same number of steps, are scored with the gold reward, and each reports
where its step time went."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from asyncrlhf.bench.pipeline import service_breakdown, summarise

pytestmark = pytest.mark.e2e

REPO = Path(__file__).resolve().parents[2]
PHASES = {"generation", "scoring", "training", "publish", "apply", "learner_wait", "generator_idle"}


def test_inprocess_beside_sync_on_the_tiny_model(tmp_path):
    """Over 60 s on a shared 2-core machine because it trains the same steps twice, in one process and as
    services (each started), and scores both runs with the gold reward."""
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    cmd = [sys.executable, "-m", "asyncrlhf.cli", "bench", "pipeline", "--config", "configs/tiny.yaml",
           "--steps", "3", "--runs", "inprocess,sync", "--json", "--out", str(tmp_path)]
    proc = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, proc.stderr[-4000:]
    result = json.loads(proc.stdout.strip().splitlines()[-1])
    runs = {r["name"]: r for r in result["runs"]}
    assert set(runs) == {"inprocess", "sync"}
    inprocess, sync = runs["inprocess"], runs["sync"]
    # the baseline trained every step in one process and checkpointed in the run layout (gold scored it)
    assert {"generation", "scoring", "training", "push", "apply"} <= set(inprocess["breakdown"])
    assert inprocess["breakdown"]["generation"] > 0 and inprocess["breakdown"]["training"] > 0
    assert set(sync["breakdown"]) == PHASES
    assert sync["breakdown"]["generation"] > 0 and sync["breakdown"]["training"] > 0
    assert sync["breakdown"]["publish"] > 0  # every version was pushed to the generator
    for r in runs.values():
        assert r["s_per_step"] > 0 and isinstance(r["gold"], float) and isinstance(r["kl"], float)
    assert result["vs_inprocess"]["sync"] == pytest.approx(sync["s_per_step"] / inprocess["s_per_step"])
    assert (tmp_path / "inprocess" / "checkpoints").is_dir()
    assert (tmp_path / "gold_vs_wallclock.png").stat().st_size > 0


def test_service_breakdown_is_per_step_and_per_generator():
    final = {
        "learner": {"asyncrlhf_learner_step_seconds_sum": 6.0, "asyncrlhf_learner_publish_seconds_sum": 1.5,
                    "asyncrlhf_learner_wait_seconds_total": 3.0},
        "generator-0": {"asyncrlhf_generator_batch_seconds_sum": 8.0,
                        "asyncrlhf_generator_weight_apply_seconds_sum": 0.6,
                        "asyncrlhf_generator_idle_seconds_total": 2.0},
        "generator-1": {"asyncrlhf_generator_batch_seconds_sum": 4.0,
                        "asyncrlhf_generator_weight_apply_seconds_sum": 0.2,
                        "asyncrlhf_generator_idle_seconds_total": 4.0},
        "reward-0": {"asyncrlhf_reward_scoring_seconds_sum": 0.9},
    }
    b = service_breakdown(final, steps=3)
    assert b == pytest.approx({"generation": 2.0, "scoring": 0.3, "training": 2.0, "publish": 0.5,
                               "apply": 0.4 / 3, "learner_wait": 1.0, "generator_idle": 1.0})


def test_summary_compares_each_backend_with_its_own_baseline(tmp_path):
    class Cfg:
        def __init__(self, backend):
            self.generator = type("G", (), {"backend": backend})()

    def run(name, backend, s, gen=1.0, train=2.0):
        return {"name": name, "cfg": Cfg(backend), "s_per_step": s, "gold": 0.1,
                "breakdown": {"generation": gen, "training": train}, "generator_idle_fraction": 0.0,
                "learner_wait_fraction": 0.0}

    runs = [run("inprocess-hf", "hf", 10.0), run("async1-hf", "hf", 8.0),
            run("inprocess-vllm", "vllm", 5.0), run("async1-vllm", "vllm", 4.5, gen=3.0)]
    result = summarise(runs, 4, tmp_path)
    assert result["vs_inprocess"] == {"async1-hf": 0.8, "async1-vllm": 0.9}
    assert result["overlap_limit_s_per_step"] == {"async1-hf": 2.0, "async1-vllm": 3.0}
    assert result["inprocess_s_per_step"] == 10.0 and result["async1_s_per_step"] == 8.0  # the first backend


def test_summary_sets_each_continuous_run_beside_its_own_batch_async1(tmp_path):
    class Cfg:
        generator = type("G", (), {"backend": "vllm"})()

    def run(name, trained, generated):
        return {"name": name, "cfg": Cfg(), "s_per_step": 5.0, "gold": 0.1,
                "breakdown": {"generation": 1.0, "training": 2.0}, "generator_idle_fraction": 0.0,
                "learner_wait_fraction": 0.0, "trained_tokens_per_s": trained,
                "generated_tokens_per_s": generated}

    result = summarise([run("async1-vllm", 100.0, 40.0), run("cont1-vllm", 150.0, 50.0),
                        run("async1-hf", 80.0, 20.0), run("cont1-hf", 60.0, 30.0)], 4, tmp_path)
    assert result["vs_async1"] == {
        "cont1-vllm": {"trained_tokens_per_s": 1.5, "generated_tokens_per_s": 1.25, "s_per_step": 1.0},
        "cont1-hf": {"trained_tokens_per_s": 0.75, "generated_tokens_per_s": 1.5, "s_per_step": 1.0}}


def test_with_episodes_the_summary_sets_episodes_trained_per_second_beside_async1(tmp_path):
    class Cfg:
        generator = type("G", (), {"backend": "vllm"})()

    def run(name, s_per_step):  # 4 groups x k 2 = 8 episodes a step
        return {"name": name, "cfg": Cfg(), "s_per_step": s_per_step, "gold": 0.1,
                "breakdown": {"generation": 1.0, "training": 2.0}, "generator_idle_fraction": 0.0,
                "learner_wait_fraction": 0.0, "trained_tokens_per_s": 10.0, "generated_tokens_per_s": 10.0,
                "episodes_per_s": 8 / s_per_step}

    result = summarise([run("async1", 2.0), run("cont1", 1.6)], 4, tmp_path)
    # 8 / 1.6 = 5 episodes/s against 8 / 2 = 4: 1.25x
    assert result["vs_async1"]["cont1"]["episodes_per_s"] == pytest.approx(1.25)
    assert [r["episodes_per_s"] for r in result["runs"]] == [4.0, 5.0]


def test_a_continuous_run_is_made_in_continuous_mode_and_the_others_in_the_configs(tmp_path):
    from asyncrlhf.bench.pipeline import run_overrides

    assert "generator.mode=continuous" in run_overrides([], "cont1-vllm", 1, 4, tmp_path)
    assert not any(o.startswith("generator.mode") for o in run_overrides([], "async1-vllm", 1, 4, tmp_path))


def test_the_variants_of_async1_change_only_their_option(tmp_path):
    from asyncrlhf.bench.pipeline import run_overrides

    base = set(run_overrides([], "async1", 1, 4, tmp_path))
    assert set(run_overrides([], "pack1", 1, 4, tmp_path)) - base >= {"learner.packing=true"}
    assert set(run_overrides([], "dyn1", 1, 4, tmp_path)) - base >= {"learner.dynamic_sampling.enabled=true"}
    # async1 beside itself with each step waiting for its push, in one bench run
    assert set(run_overrides([], "waitpush1", 1, 4, tmp_path)) - base >= {"learner.background_publish=false"}
    assert set(run_overrides([], "tis1", 1, 4, tmp_path)) - base >= {"learner.rollout_correction=tis"}
    changed = ("learner.packing", "learner.dynamic", "learner.background", "learner.rollout")
    assert not any(o.startswith(changed) for o in base)


def test_an_earlier_benchs_run_is_refused_and_kept(tmp_path, capsys):
    """A run directory left by an earlier bench would be resumed (nothing trained, its figures reported as
    new): the bench refuses it, says what to do, and touches nothing."""
    from asyncrlhf.bench.pipeline import main

    earlier = tmp_path / "sync" / "checkpoints" / "step-000003"
    earlier.mkdir(parents=True)
    with pytest.raises(SystemExit) as exit_:
        main(["--config", "configs/tiny.yaml", "--runs", "inprocess,sync", "--out", str(tmp_path)])
    assert exit_.value.code == 2
    err = capsys.readouterr().err
    assert str(tmp_path / "sync") in err and "--overwrite" in err and "--out" in err
    assert earlier.is_dir()
    assert not (tmp_path / "inprocess").exists()  # refused before any run started


def test_overwrite_replaces_only_this_benchs_runs(tmp_path):
    from asyncrlhf.bench.pipeline import fresh_run_dirs

    for name in ("sync-hf", "async1-hf", "keep"):
        (tmp_path / name / "checkpoints").mkdir(parents=True)
    (tmp_path / "result.json").write_text("{}")
    fresh_run_dirs(tmp_path, ["inprocess-hf", "sync-hf", "async1-hf"], overwrite=True)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["keep", "result.json"]
    fresh_run_dirs(tmp_path, ["sync-hf"], overwrite=False)  # nothing left there: nothing to refuse


def test_bench_judge_measures_agreement_calls_and_the_pipeline_with_a_judge_beside_a_rule(tmp_path):
    """`asyncrlhf bench judge` at its smallest: the tiny model as the policy and as the judge (in
    transformers), 4 samples, two runs of 2 steps (the judge's reward, the gold rule's)."""
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    judge = "reward.scorers=[{kind: judge, model: {name_or_path: tiny}, engine: {backend: hf, device: cpu}}]"
    cmd = [sys.executable, "-m", "asyncrlhf.cli", "bench", "judge", "--config", "configs/tiny.yaml",
           "--samples", "4", "--steps", "2", "--json", "--out", str(tmp_path), judge]
    proc = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, proc.stderr[-4000:]
    result = json.loads(proc.stdout.strip().splitlines()[-1])
    assert result["samples"] == 4 and result["requests"] == len({(e["prompt"], e["completion"])
                                                                   for e in result["examples"]})
    assert result["calls_per_s"] > 0 and result["cached_calls_per_s"] > 0 and -1 <= result["spearman"] <= 1
    pipeline = result["pipeline"]
    for name in ("judge", "rule"):
        run = pipeline[name]
        assert run["s_per_step"] > 0 and run["bound_by"] in ("generation", "scoring", "training")
        assert run["breakdown"]["scoring"] > 0
    assert pipeline["judge"]["judge_requests_per_s"] > 0 and pipeline["rule"]["judge_requests_per_s"] == 0
    assert pipeline["judge_vs_rule_s_per_step"] == pytest.approx(
        pipeline["judge"]["s_per_step"] / pipeline["rule"]["s_per_step"])

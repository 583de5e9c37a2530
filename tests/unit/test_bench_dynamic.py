"""`asyncrlhf bench dynamic`: dynamic sampling on and off read at the same number of generated samples, from
the runs' consumed logs."""

import pytest

from asyncrlhf.bench.dynamic import compare, consumed_by_version, gold_at
from asyncrlhf.config import load_config
from asyncrlhf.consumed import Kind


def test_each_version_is_placed_at_the_groups_consumed_when_it_was_trained():
    rows = [{"kind": Kind.LINEAGE, "version": 0, "group_ids": [], "at": 0.0},
            {"kind": Kind.FILTERED, "version": 0, "group_ids": ["a"], "at": 1.0},
            {"kind": Kind.TRAINED, "version": 1, "group_ids": ["b", "c"], "at": 2.0},
            {"kind": Kind.FILTERED, "version": 1, "group_ids": ["d"], "at": 4.0},
            {"kind": Kind.DROPPED, "version": 1, "group_ids": ["x"], "at": 4.5},  # never sampled anew
            {"kind": Kind.TRAINED, "version": 2, "group_ids": ["e", "f"], "at": 3.0}]  # sorted by time
    assert consumed_by_version(rows) == {1: 3, 2: 5}


def test_the_gold_read_is_the_last_checkpoint_within_the_budget():
    run = {"gold_by_version": {0: 0.1, 1: 0.2, 2: 0.3, 3: 0.9}, "samples_by_version": {1: 8, 2: 16, 3: 24}}
    assert gold_at(run, 20) == (0.3, 16)
    assert gold_at(run, 24) == (0.9, 24)
    assert gold_at(run, 4) == (0.1, 0)  # no checkpoint within it: the initial policy


def _run(name, golds, samples, filtered, length):
    return {"name": name, "gold": golds[max(golds)], "gold_by_version": golds, "samples_by_version": samples,
            "described": {"samples": max(samples.values()), "filtered_share": filtered,
                          "mean_trained_length": length}}


def test_on_and_off_are_compared_at_each_seeds_common_budget_with_their_spread():
    runs = [_run("async1-s0", {0: 0.2, 1: 0.3, 2: 0.4}, {1: 16, 2: 32}, 0.0, 10.0),
            _run("dyn1-s0", {0: 0.2, 1: 0.5, 2: 0.7}, {1: 28, 2: 52}, 0.4, 10.5),
            _run("async1-s1", {0: 0.2, 1: 0.35, 2: 0.45}, {1: 16, 2: 32}, 0.0, 12.0),
            _run("dyn1-s1", {0: 0.2, 1: 0.6, 2: 0.8}, {1: 20, 2: 40}, 0.2, 12.0)]
    result = compare(runs, [0, 1])
    by = {r["name"]: r for r in result["runs"]}
    assert by["dyn1-s0"]["budget_samples"] == 32 and by["dyn1-s0"]["gold_at_budget"] == 0.5  # not its 0.7
    assert by["async1-s0"]["gold_at_budget"] == 0.4
    assert by["dyn1-s1"]["gold_at_budget"] == 0.6 and by["dyn1-s1"]["checkpoint_samples"] == 20
    assert result["dyn1"]["gold_min"] == 0.5 and result["dyn1"]["gold_max"] == 0.6
    assert result["async1"]["gold_mean"] == pytest.approx(0.425)
    assert result["length_on_vs_off"] == pytest.approx(11.25 / 11.0)
    assert result["length_within_target"]


def test_the_dynamic_sampling_config_scores_its_answers_one_or_zero():
    """Strict length bands: every score is 1 or 0, so groups of equal rewards (nothing to learn) are many."""
    from asyncrlhf.rewards import build_reward
    from asyncrlhf.rewards.base import Item

    cfg = load_config(["configs/dynamic_rloo.yaml"], ["learner.dynamic_sampling.enabled=true"])
    assert cfg.learner.algorithm == "rloo" and cfg.generator.samples_per_prompt > 1
    assert cfg.reward.scorers[0].args == {"strict": True} == cfg.evaluator.gold.args
    prompt = "Describe a cat in one sentence."
    reward = build_reward(cfg.reward)
    scores = reward.score([Item(prompt, "A cat is a small furry animal that purrs.", True),
                           Item(prompt, "Cat.", True), Item(prompt, " ".join(["word"] * 40), True)])
    assert scores.scores == [1.0, 0.0, 0.0]



def _run_dir(path, steps, failed=None):
    """A run directory as `asyncrlhf up` leaves it: its summary, a consumed log of `steps` trained steps."""
    import json

    path.mkdir()
    (path / "up_summary.json").write_text(json.dumps({"failed": failed, "final_metrics": {}}))
    rows = [{"kind": "lineage", "lineage": 1, "from_lineage": 0, "version": 0, "group_ids": [], "at": 0.0}]
    rows += [{"kind": "trained", "version": v, "group_ids": [f"g{v}"], "at": float(v)}
             for v in range(1, steps + 1)]
    (path / "consumed.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def test_only_a_run_that_trained_its_steps_without_failing_is_read_back(tmp_path):
    """`--keep` reads back what `finished` accepts; anything else would resume from its checkpoints."""
    from asyncrlhf.bench.pipeline import finished

    assert finished(_run_dir(tmp_path / "done", 6), 6)
    assert not finished(_run_dir(tmp_path / "short", 5), 6)
    assert not finished(_run_dir(tmp_path / "failed", 6, failed="learner exited 1"), 6)
    stopped = tmp_path / "stopped"
    stopped.mkdir()
    assert not finished(stopped, 6)  # stopped before `up` wrote its summary
    (stopped / "up_summary.json").write_text('{"failed": nu')  # cut short
    assert not finished(stopped, 6)

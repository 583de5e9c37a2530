"""The staleness study's bookkeeping: what the consumed log says was trained, and the per-cell summary."""

import json

import pytest

from asyncrlhf.bench.staleness import staleness_trained, summarize
from asyncrlhf.consumed import log_path

pytestmark = pytest.mark.unit


def write_log(run_dir, rows):
    log_path(run_dir).write_text("".join(json.dumps(r) + "\n" for r in rows))


def test_staleness_trained_excludes_the_exact_warm_up_and_counts_every_group(tmp_path):
    # N = 2, exact: versions 1, 2 train on the initial policy's groups (staleness 0, 1), then 2 from step 3
    write_log(tmp_path, [
        {"kind": "trained", "version": 2, "group_ids": ["g0", "g1"], "staleness": [0, 0]},
        {"kind": "trained", "version": 3, "group_ids": ["g2", "g3"], "staleness": [1, 1]},
        {"kind": "dropped", "version": 3, "group_ids": ["g9"], "staleness": 1,
         "reason": "off-schedule"},
        {"kind": "trained", "version": 4, "group_ids": ["g4", "g5"], "staleness": [2, 2]},
        {"kind": "trained", "version": 5, "group_ids": ["g6", "g7"], "staleness": [2, 2]},
    ])
    got = staleness_trained(tmp_path, 2, "exact")
    assert (got["min_staleness_trained"], got["max_staleness_trained"]) == (2, 2)
    assert got["staleness_histogram"] == {"0": 2, "1": 2, "2": 4}
    assert (got["warmup_steps"], got["steps"], got["dropped"]) == (2, 4, 1)
    # the paper's protocol has no warm-up: its cycle 0, 1, 2 is the point
    paper = staleness_trained(tmp_path, 2, "paper")
    assert (paper["min_staleness_trained"], paper["max_staleness_trained"]) == (0, 2)
    assert paper["warmup_steps"] == 0


def test_summarize_means_over_seeds_with_the_spread():
    runs = [{"algorithm": "rloo", "staleness": 4, "gold_reward": g, "win_rate": w, "kl": k}
            for g, w, k in [(0.2, 0.50, 1.0), (0.4, 0.75, 3.0)]]
    [row] = summarize(runs)
    # means: (0.2 + 0.4) / 2 = 0.3, (0.5 + 0.75) / 2 = 0.625, (1 + 3) / 2 = 2; spreads 0.2, 0.25, 2
    assert row["seeds"] == 2
    assert (row["gold_reward"], row["win_rate"], row["kl"]) == pytest.approx((0.3, 0.625, 2.0))
    spreads = (row["gold_reward_spread"], row["win_rate_spread"], row["kl_spread"])
    assert spreads == pytest.approx((0.2, 0.25, 2.0))


def test_each_algorithm_gets_the_config_without_the_other_algorithms_sections(tmp_path):
    from asyncrlhf.bench.staleness import Study
    from asyncrlhf.config import load_config

    study = Study(["configs/demo.yaml"], [], ["online_dpo", "rloo"], [0, 4], [0], 10, "exact", tmp_path)
    for algorithm in ("online_dpo", "rloo", "ppo"):  # demo.yaml sets learner.online_dpo.beta
        cfg = load_config(study.algorithm_config(algorithm), study.run_overrides(algorithm, 4, 0))
        assert cfg.learner.algorithm == algorithm and cfg.learner.staleness_mode == "exact"
    assert load_config(study.algorithm_config("online_dpo")).learner.online_dpo.beta == 0.1
    with pytest.raises(SystemExit, match="unknown algorithm 'sac'"):
        study.algorithm_config("sac")


def test_a_result_is_reused_only_under_the_same_config_and_reward_model(tmp_path):
    import torch
    from safetensors.torch import save_file

    from asyncrlhf.bench.staleness import Study, reusable, run_config, settings

    rm = tmp_path / "rm"
    rm.mkdir()
    save_file({"score.weight": torch.ones(2, 3)}, rm / "model.safetensors")

    def fingerprint(root, overrides=()):
        study = Study(["configs/tiny.yaml"], [*overrides, f"reward.scorers=[{{kind: model, path: {rm}}}]"],
                      ["rloo"], [0, 2], [0], 5, "exact", root)
        return settings(study, run_config(study, "rloo", 2, 0)[2])

    first = fingerprint(tmp_path / "a")
    assert set(first) == {"config", "reward_model_0"}
    (rm / "training.json").write_text('{"seconds": 517.2}')  # train-rm's summary: timings, not the model
    assert fingerprint(tmp_path / "a") == first
    # another --out (run.dir) is the same study; copied results resume there
    assert fingerprint(tmp_path / "b") == first
    assert fingerprint(tmp_path / "a", ["learner.lr=1e-3"])["config"] != first["config"]
    save_file({"score.weight": torch.full((2, 3), 2.0)}, rm / "model.safetensors")  # retrained: same path
    retrained = fingerprint(tmp_path / "a")
    assert retrained["reward_model_0"] != first["reward_model_0"]
    assert retrained["config"] != first["config"]

    path = tmp_path / "results" / "rloo-exact2-seed0.json"
    assert reusable(path, first) is None  # not made yet
    path.parent.mkdir()
    path.write_text(json.dumps({"gold_reward": 0.5, "settings": first}))
    assert reusable(path, first)["gold_reward"] == 0.5
    with pytest.raises(SystemExit, match=r"other settings \(config, reward_model_0.*another --out"):
        reusable(path, retrained)
    path.write_text(json.dumps({"gold_reward": 0.5}))  # made before results carried their settings
    with pytest.raises(SystemExit, match="other settings"):
        reusable(path, first)


def test_finished_only_tables_the_finished_runs_lists_the_others_and_trains_nothing(tmp_path, capsys):
    from asyncrlhf.bench.staleness import main, parse, run_config, settings

    argv = ["--quick", "--finished-only", "--json", "--out", str(tmp_path)]
    with pytest.raises(SystemExit, match="no run of this study has finished .*without --finished-only"):
        main(argv)
    study, _ = parse(argv)
    result = {"algorithm": "rloo", "staleness": 2, "mode": "exact", "seed": 0, "min_staleness_trained": 2,
              "max_staleness_trained": 2, "staleness_histogram": {"0": 2, "1": 2, "2": 6}, "steps": 5,
              "gold_reward": 0.25, "win_rate": 0.625, "kl": 1.5, "seconds": 60.0,
              "settings": settings(study, run_config(study, "rloo", 2, 0)[2])}
    (tmp_path / "results").mkdir()
    (tmp_path / "results" / "rloo-exact2-seed0.json").write_text(json.dumps(result))
    capsys.readouterr()
    assert main(argv) == 0
    out = json.loads(capsys.readouterr().out)
    assert [r["gold_reward"] for r in out["runs"]] == [0.25]
    assert out["missing"] == ["online_dpo-exact0-seed0", "online_dpo-exact2-seed0", "rloo-exact0-seed0"]
    assert not (tmp_path / "runs").exists()  # nothing trained
    assert (tmp_path / "frontier.png").exists()
    assert len(json.loads((tmp_path / "study.json").read_text())["missing"]) == 3


def test_finished_only_compares_results_under_the_reward_model_they_recorded_not_a_local_rebuild(tmp_path,
                                                                                               capsys):
    """train-rm is deterministic on one machine, not across CPUs: a rebuild elsewhere has other tensors.
    --finished-only trains nothing, so it tables results made under the RM they recorded; results made
    under two different RMs are still never mixed."""
    import torch
    from safetensors.torch import save_file

    from asyncrlhf.bench.staleness import main, parse, run_config, settings

    rm = tmp_path / "rm"
    rm.mkdir()
    save_file({"score.weight": torch.ones(2, 3)}, rm / "model.safetensors")
    out = tmp_path / "study"
    argv = ["--quick", "--finished-only", "--json", "--out", str(out), "--reward-model", str(rm)]
    study, _ = parse(argv)

    def result(algorithm, n):
        return {"algorithm": algorithm, "staleness": n, "mode": "exact", "seed": 0,
                "min_staleness_trained": n, "max_staleness_trained": n,
                "staleness_histogram": {str(n): 10}, "steps": 5,
                "gold_reward": 0.25, "win_rate": 0.625, "kl": 1.5, "seconds": 60.0,
                "settings": settings(study, run_config(study, algorithm, n, 0)[2])}

    made = [result("rloo", 0), result("rloo", 2)]
    (out / "results").mkdir(parents=True)
    for r in made:
        (out / "results" / f"rloo-exact{r['staleness']}-seed0.json").write_text(json.dumps(r))
    save_file({"score.weight": torch.full((2, 3), 1.0 + 1e-6)}, rm / "model.safetensors")  # rebuilt elsewhere
    capsys.readouterr()
    assert main(argv) == 0
    assert [r["staleness"] for r in json.loads(capsys.readouterr().out)["runs"]] == [0, 2]
    # a result made under the rebuilt RM does not join the others
    study2, _ = parse(argv)
    mixed = {**made[1], "settings": settings(study2, run_config(study2, "rloo", 2, 0)[2])}
    assert mixed["settings"]["reward_model_0"] != made[1]["settings"]["reward_model_0"]
    (out / "results" / "rloo-exact2-seed0.json").write_text(json.dumps(mixed))
    with pytest.raises(SystemExit, match=r"rloo-exact2-seed0.json was made under other settings"):
        main(argv)

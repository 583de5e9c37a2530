"""`asyncrlhf bench learner` runs end to end on the tiny model: samples, trains padded and packed (varlen
attention and the block-diagonal mask) side by side (same losses), and replays dynamic sampling's filter on
the gold reward."""

import json

import pytest

from asyncrlhf.bench import learner

pytestmark = pytest.mark.integration


def test_the_learner_bench_reports_both_modes_and_both_length_distributions(tmp_path):
    out = tmp_path / "figures.json"
    code = learner.main(["--config", "configs/tiny.yaml", "--prompts", "12", "--json", str(out),
                         f"run.dir={tmp_path}/run", "learner.algorithm=rloo"])
    assert code == 0
    figures = json.loads(out.read_text())
    assert figures["steps"] == 3 and figures["max_loss_diff"] <= 1e-5
    assert figures["packed"]["padding_share"] == 0.0 < figures["padded"]["padding_share"]
    assert figures["packed"]["tokens"] == figures["padded"]["tokens"] > 0
    assert figures["packed_mask"]["tokens"] == figures["padded"]["tokens"]  # the mask path, the same steps
    assert figures["speedup_mask"] > 0
    ds = figures["dynamic_sampling"]
    assert ds["groups"] == 12 and ds["off"]["samples"] == 12 * 2

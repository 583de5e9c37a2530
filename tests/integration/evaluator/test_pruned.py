"""A checkpoint pruned before or while the evaluator loads it is skipped, not a crash."""

import shutil

import pytest

from asyncrlhf.config import load_config
from services.evaluator.loop import Evaluator

pytestmark = pytest.mark.integration


def test_a_pruned_checkpoint_is_skipped_and_counted(tmp_path, redis_url, run_name):
    cfg = load_config(["configs/tiny.yaml"], [f"redis.url={redis_url}", f"run.name={run_name}",
                                              f"run.dir={tmp_path}/run"])
    checkpoints = cfg.run.path / "checkpoints"
    half_deleted = checkpoints / "step-000003"
    (half_deleted / "hf").mkdir(parents=True)  # rmtree got as far as the weights
    (half_deleted / "learner_state.json").write_text('{"version": 3}')
    evaluator = Evaluator(cfg).start()
    evaluator.evaluate_checkpoint(str(half_deleted), 3)
    assert evaluator.metrics.skipped.labels("missing")._value.get() == 1
    shutil.rmtree(half_deleted)
    evaluator.evaluate_checkpoint(str(half_deleted), 3)  # gone altogether
    assert evaluator.metrics.skipped.labels("missing")._value.get() == 2
    evaluator.http.stop()

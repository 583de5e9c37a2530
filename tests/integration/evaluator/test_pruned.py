"""A checkpoint pruned before or while the evaluator loads it is skipped, not a crash."""

import shutil

import pytest

from asyncrlhf.config import load_config
from asyncrlhf.training.checkpoint import HF, LearnerState, step_dir, write_state
from services.evaluator.loop import Evaluator

pytestmark = pytest.mark.integration


def test_a_pruned_checkpoint_is_skipped_and_counted(tmp_path, redis_url, run_name):
    cfg = load_config(["configs/tiny.yaml"], [f"redis.url={redis_url}", f"run.name={run_name}",
                                              f"run.dir={tmp_path}/run"])
    half_deleted = step_dir(cfg.run.path, 3)
    (half_deleted / HF).mkdir(parents=True)  # rmtree got as far as the weights
    write_state(half_deleted, LearnerState(version=3))
    evaluator = Evaluator(cfg).start()
    evaluator.evaluate_checkpoint(str(half_deleted), 3)
    assert evaluator.metrics.skipped.labels("missing")._value.get() == 1
    shutil.rmtree(half_deleted)
    evaluator.evaluate_checkpoint(str(half_deleted), 3)  # gone altogether
    assert evaluator.metrics.skipped.labels("missing")._value.get() == 2
    evaluator.http.stop()

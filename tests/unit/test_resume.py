"""What `asyncrlhf up` does with a run that has a checkpoint (`asyncrlhf.resume`): resume and say so, refuse
when the model, tokenizer, algorithm or adapter changed (naming the keys), or start afresh with the old
directory moved aside. The checkpoint here is written through `training.checkpoint`'s own functions (state,
config, `latest`); tests/e2e/test_up.py does the same through `up` on a trained run."""

from __future__ import annotations

import pytest
import yaml

from asyncrlhf.config import load_config
from asyncrlhf.resume import changes, prepare_run_dir
from asyncrlhf.training import checkpoint

pytestmark = pytest.mark.unit


def config(tmp_path, *overrides):
    return load_config(["configs/tiny.yaml"], [f"run.dir={tmp_path}/run", "run.name=r", *overrides])


def trained(cfg, version=5):
    """A run directory whose latest checkpoint is policy `version`, trained with `cfg`."""
    path = checkpoint.step_dir(cfg.run.path, version)
    path.mkdir(parents=True)
    checkpoint.write_state(path, checkpoint.LearnerState(version=version))
    (path / checkpoint.CONFIG).write_text(cfg.to_yaml())
    checkpoint.publish(path)
    return path


def decide(cfg, fresh=False, anyway=False):
    said: list[str] = []
    flags = ["--fresh"] * fresh + ["--resume-anyway"] * anyway
    refused = prepare_run_dir(cfg, flags, say=said.append)
    return refused, said


def test_the_same_config_resumes_saying_from_which_step_and_checkpoint(tmp_path):
    path = trained(config(tmp_path))
    refused, said = decide(config(tmp_path, "learner.lr=1e-3", "learner.total_steps=9"))  # may change
    assert refused is None
    assert said == [f"resuming run r from step 4 (checkpoint {path})"]  # version 5 = 4 optimizer steps


def test_a_changed_model_and_lora_are_refused_naming_the_keys(tmp_path):
    trained(config(tmp_path))
    refused, said = decide(config(tmp_path, "model.name_or_path=smollm2-135m-instruct",
                                  "learner.lora.enabled=true"))
    assert said == []
    assert "model.name_or_path: 'tiny' -> 'smollm2-135m-instruct'" in refused
    assert "learner.lora.enabled: False -> True" in refused
    assert "--fresh" in refused and "--resume-anyway" in refused
    refused, said = decide(config(tmp_path, "model.tiny.hidden=128"), anyway=True)
    assert refused is None and "resuming although model.tiny: " in said[1]


def test_fresh_moves_the_old_run_aside_and_keeps_it(tmp_path):
    cfg = config(tmp_path)
    trained(cfg)
    refused, said = decide(config(tmp_path, "learner.algorithm=rloo"), fresh=True)
    (moved,) = [p for p in tmp_path.iterdir() if p.name.startswith("run.")]
    assert refused is None
    assert said == [f"--fresh: moved the earlier run directory {cfg.run.path} to {moved}; run r starts "
                    "afresh"]
    assert checkpoint.step_dir(moved, 5).is_dir()
    assert [p.name for p in cfg.run.path.iterdir()] == ["config.yaml"]  # the new run's, and nothing else
    assert decide(cfg, fresh=True, anyway=True)[0].startswith("--fresh starts afresh and --resume-anyway")


def test_fresh_with_a_named_redis_asks_for_another_run_name(tmp_path):
    refused, _ = decide(config(tmp_path, "redis.url=redis://redis:6379/0"), fresh=True)
    assert "pick another run.name" in refused


def test_keys_that_decide_nothing_are_not_compared():
    saved = yaml.safe_load(load_config(["configs/demo.yaml"], []).to_yaml())
    now = yaml.safe_load(load_config(["configs/demo.yaml"], ["model.tiny.hidden=128", "model.revision=main",
                                                               "learner.lora.r=8"]).to_yaml())
    # tiny's shape (not the tiny model), a branch (the checkpoint holds the commit it resolved to): nothing
    assert [c.key for c in changes(saved, now)] == ["learner.lora.r"]
    pinned = {**now, "model": {**now["model"], "revision": "a" * 40}}
    assert [c.key for c in changes(saved, pinned)] == ["model.revision", "learner.lora.r"]
    def lora(tree, **kw):
        return {**tree, "learner": {**tree["learner"], "lora": {**tree["learner"]["lora"], **kw}}}

    no_lora = lora(saved, enabled=False)
    assert changes(no_lora, lora(no_lora, r=8)) == []  # the adapter's shape, with no adapter

"""A user's DeepSpeed JSON: "auto" filled from the learner section, its values win (and say so), and what
cannot be honoured fails at start naming both sides."""

import json

import pytest

from asyncrlhf.config import load_config
from asyncrlhf.training.user_deepspeed import DeepSpeedConfigError, resolve

pytestmark = pytest.mark.unit


def learner(tmp_path, config: dict, *overrides: str):
    path = tmp_path / "ds.json"
    path.write_text(json.dumps(config))
    return load_config(["configs/tiny.yaml"], [f"learner.deepspeed.config_file={path}", *overrides]).learner


def test_auto_values_are_filled_from_the_learner_section(tmp_path):
    cfg = learner(tmp_path, {
        "train_micro_batch_size_per_gpu": "auto", "train_batch_size": "auto", "gradient_clipping": "auto",
        "gradient_accumulation_steps": "auto", "zero_optimization": {"stage": "auto"},
        "optimizer": {"type": "AdamW", "params": {"lr": "auto", "betas": "auto", "eps": "auto",
                                                  "weight_decay": "auto"}},
        "scheduler": {"type": "WarmupDecayLR",
                      "params": {"warmup_num_steps": "auto", "total_num_steps": "auto",
                                 "warmup_max_lr": "auto", "warmup_min_lr": "auto"}},
    }, "learner.lr=2e-5", "learner.micro_batch_size=3", "learner.max_grad_norm=0.5", "learner.warmup_steps=2",
        "learner.total_steps=7", "learner.deepspeed.zero_stage=2")
    user = resolve(cfg, world=2)
    c = user.config
    assert c["train_micro_batch_size_per_gpu"] == 3 and c["train_batch_size"] == 6  # 3 x 2 ranks
    assert c["gradient_accumulation_steps"] == 1 and c["gradient_clipping"] == 0.5
    assert c["zero_optimization"]["stage"] == 2
    assert c["optimizer"]["params"] == {"lr": 2e-5, "betas": [0.9, 0.999], "eps": 1e-8, "weight_decay": 0.0}
    assert c["scheduler"]["params"] == {"warmup_num_steps": 2, "total_num_steps": 7, "warmup_max_lr": 2e-5,
                                        "warmup_min_lr": 0.0}
    assert user.learner.lr == 2e-5 and user.learner.deepspeed.zero_stage == 2


def test_json_values_win_over_the_learner_section_and_each_is_reported(tmp_path):
    cfg = learner(tmp_path, {"train_micro_batch_size_per_gpu": 2, "gradient_clipping": 0.3,
                             "zero_optimization": {"stage": 3, "offload_optimizer": {"device": "cpu"}},
                             "bf16": {"enabled": True},
                             "optimizer": {"type": "AdamW", "params": {"lr": 1e-3, "betas": [0.8, 0.9]}}})
    user = resolve(cfg, world=1)
    eff = user.learner
    assert (eff.micro_batch_size, eff.max_grad_norm, eff.lr) == (2, 0.3, 1e-3)
    assert eff.deepspeed.zero_stage == 3 and eff.deepspeed.offload_optimizer and eff.deepspeed.bf16
    text = "\n".join(user.overrides)
    for line in ["train_micro_batch_size_per_gpu=2 wins over learner.micro_batch_size=4",
                 "zero_optimization.stage=3 wins over learner.deepspeed.zero_stage=0",
                 "optimizer.params.lr=0.001 wins over learner.lr=0.0001",
                 "gradient_clipping=0.3 wins over learner.max_grad_norm=1.0"]:
        assert line in text
    assert cfg.deepspeed.zero_stage == 0  # the loaded config itself is untouched


def test_gradient_accumulation_other_than_one_fails_naming_groups_per_step(tmp_path):
    cfg = learner(tmp_path, {"gradient_accumulation_steps": 4})
    with pytest.raises(DeepSpeedConfigError, match="gradient_accumulation_steps=4.*learner.groups_per_step"):
        resolve(cfg, world=1)


def test_a_train_batch_size_that_disagrees_fails_naming_both(tmp_path):
    cfg = learner(tmp_path, {"train_batch_size": 16, "train_micro_batch_size_per_gpu": 4})
    with pytest.raises(DeepSpeedConfigError, match=r"train_batch_size=16.*per_gpu=4.*= 8"):
        resolve(cfg, world=2)


def test_an_auto_scheduler_key_we_cannot_fill_fails(tmp_path):
    cfg = learner(tmp_path, {"scheduler": {"type": "OneCycle", "params": {"cycle_momentum": "auto"}}})
    with pytest.raises(DeepSpeedConfigError, match="scheduler.params.cycle_momentum"):
        resolve(cfg, world=1)


def test_a_missing_or_broken_file_fails_clearly(tmp_path):
    cfg = load_config(["configs/tiny.yaml"], [f"learner.deepspeed.config_file={tmp_path}/nope.json"]).learner
    with pytest.raises(FileNotFoundError, match="nope.json does not exist"):
        resolve(cfg, world=1)
    (tmp_path / "bad.json").write_text("{stage: 3")
    cfg = load_config(["configs/tiny.yaml"], [f"learner.deepspeed.config_file={tmp_path}/bad.json"]).learner
    with pytest.raises(DeepSpeedConfigError, match="not valid JSON"):
        resolve(cfg, world=1)

"""A user's own DeepSpeed JSON (`learner.deepspeed.config_file`): the source of truth for what it sets.

Which wins, for every key the JSON sets (documented here and logged at start, never silently):

    JSON key                                   wins over                  "auto" is filled from
    zero_optimization.stage                    learner.deepspeed.zero_stage        the same
    zero_optimization.offload_optimizer        learner.deepspeed.offload_optimizer  -
    bf16.enabled                               learner.deepspeed.bf16              the same
    train_micro_batch_size_per_gpu             learner.micro_batch_size            the same
    gradient_clipping                          learner.max_grad_norm               the same
    optimizer.params.lr / weight_decay         learner.lr / learner.weight_decay   the same
    optimizer.params.betas / eps               -                                   (0.9, 0.999) / 1e-8
    scheduler (the whole block)                learner.lr_schedule, warmup_steps    warmup_num_steps,
                                                                                   total_num_steps, ...

The JSON's values are folded back into the learner section (`effective_learner`), so the trainer, the weight
gather for pushes and the checkpoints all follow the stage and sizes in effect, and the run's saved config
records them. Two keys cannot be honoured and fail at start naming both sides: `gradient_accumulation_steps`
other than 1 (the trainer accumulates over a whole step itself: size a step with `learner.groups_per_step`)
and a `train_batch_size` other than micro-batch x world size.
"""

from __future__ import annotations

import copy
import json
import logging
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from asyncrlhf.config import LearnerConfig

log = logging.getLogger("asyncrlhf.learner")
AUTO = "auto"
_ADAM_DEFAULTS = {"betas": [0.9, 0.999], "eps": 1e-8}


class DeepSpeedConfigError(ValueError):
    """The user's DeepSpeed JSON cannot be honoured as written; the message says which keys and what to do."""


@dataclass
class UserDeepSpeed:
    """The user's JSON with every "auto" filled, and the learner section with the JSON's values in effect."""

    config: dict[str, Any]
    learner: Any  # LearnerConfig with the JSON's values folded in
    overrides: list[str] = field(default_factory=list)  # "JSON key=value wins over learner.key=value"


def read_json(path_text: str) -> dict[str, Any]:
    path = Path(path_text)
    if not path.is_file():
        raise FileNotFoundError(f"learner.deepspeed.config_file {path} does not exist")
    try:
        data = json.loads(path.read_text())
    except json.JSONDecodeError as err:
        raise DeepSpeedConfigError(f"learner.deepspeed.config_file {path} is not valid JSON: {err}") from err
    if not isinstance(data, dict):
        raise DeepSpeedConfigError(f"learner.deepspeed.config_file {path} must hold a JSON object")
    return data


def resolve(cfg: LearnerConfig, world: int) -> UserDeepSpeed:
    """Read `cfg.deepspeed.config_file`, fill its "auto" values from `cfg`, check what cannot be honoured,
    and fold what it sets into the learner section."""
    raw = read_json(str(cfg.deepspeed.config_file))
    config = copy.deepcopy(raw)
    overrides: list[str] = []
    ds: dict[str, Any] = {}
    learner: dict[str, Any] = {}

    def take(json_key: str, value: Any, learner_key: str, current: Any, target: dict, name: str) -> Any:
        """The JSON's `value` (or `current` for "auto"), noting when it replaces a different learner value."""
        if value == AUTO:
            return current
        if value != current:
            overrides.append(f"{json_key}={value} wins over {learner_key}={current}")
        target[name] = value
        return value

    zero = config.setdefault("zero_optimization", {})
    zero["stage"] = take("zero_optimization.stage", zero.get("stage", 0), "learner.deepspeed.zero_stage",
                         cfg.deepspeed.zero_stage, ds, "zero_stage")
    offload = zero.get("offload_optimizer", {}).get("device", "none") not in (None, "none")
    take("zero_optimization.offload_optimizer", offload, "learner.deepspeed.offload_optimizer",
         cfg.deepspeed.offload_optimizer, ds, "offload_optimizer")
    if "bf16" in config:
        config["bf16"]["enabled"] = take("bf16.enabled", config["bf16"].get("enabled", False),
                                         "learner.deepspeed.bf16", cfg.deepspeed.bf16, ds, "bf16")
    elif cfg.deepspeed.bf16:
        overrides.append("the JSON has no bf16 block: learner.deepspeed.bf16=True does not apply")
        ds["bf16"] = False
    micro = take("train_micro_batch_size_per_gpu", config.get("train_micro_batch_size_per_gpu", AUTO),
                 "learner.micro_batch_size", cfg.micro_batch_size, learner, "micro_batch_size")
    config["train_micro_batch_size_per_gpu"] = micro
    config["gradient_clipping"] = take("gradient_clipping", config.get("gradient_clipping", AUTO),
                                       "learner.max_grad_norm", cfg.max_grad_norm, learner, "max_grad_norm")
    _check_batch(config, micro, world)
    if "optimizer" in config:
        _fill_optimizer(config["optimizer"], cfg, learner, take)
    if "scheduler" in config:
        _fill_scheduler(config["scheduler"], cfg, learner.get("lr", cfg.lr))
        overrides.append(f"scheduler {config['scheduler'].get('type')} wins over learner.lr_schedule="
                         f"{cfg.lr_schedule} and learner.warmup_steps={cfg.warmup_steps}")
    config.setdefault("steps_per_print", 10**9)
    effective = cfg.model_copy(update={**learner, "deepspeed": cfg.deepspeed.model_copy(update=ds)})
    return UserDeepSpeed(config, effective, overrides)


def _check_batch(config: dict[str, Any], micro: int, world: int) -> None:
    accumulation = config.get("gradient_accumulation_steps", AUTO)
    if accumulation not in (AUTO, 1):
        raise DeepSpeedConfigError(
            f"gradient_accumulation_steps={accumulation} in the DeepSpeed JSON conflicts with "
            "learner.groups_per_step: asyncrlhf accumulates over a whole step's groups itself. Set it to 1 "
            "or \"auto\" and size a step with learner.groups_per_step.")
    config["gradient_accumulation_steps"] = 1
    batch = config.get("train_batch_size", AUTO)
    if batch not in (AUTO, micro * world):
        raise DeepSpeedConfigError(
            f"train_batch_size={batch} in the DeepSpeed JSON conflicts with train_micro_batch_size_per_gpu="
            f"{micro} (learner.micro_batch_size) x {world} ranks = {micro * world}. Set it to \"auto\".")
    config["train_batch_size"] = micro * world


def _fill_optimizer(block: dict[str, Any], cfg: LearnerConfig, learner: dict[str, Any], take) -> None:
    params = block.setdefault("params", {})
    params["lr"] = take("optimizer.params.lr", params.get("lr", AUTO), "learner.lr", cfg.lr, learner, "lr")
    params["weight_decay"] = take("optimizer.params.weight_decay", params.get("weight_decay", AUTO),
                                  "learner.weight_decay", cfg.weight_decay, learner, "weight_decay")
    if str(block.get("type", "")).lower() in ("adam", "adamw"):
        for key, default in _ADAM_DEFAULTS.items():
            if params.get(key, AUTO) == AUTO:
                params[key] = default


def _fill_scheduler(block: dict[str, Any], cfg: LearnerConfig, lr: float) -> None:
    fill = {"warmup_num_steps": cfg.warmup_steps, "total_num_steps": cfg.total_steps, "warmup_max_lr": lr,
            "warmup_min_lr": 0.0, "cycle_max_lr": lr, "lr_range_test_min_lr": lr}
    params = block.setdefault("params", {})
    for key, value in params.items():
        if value == AUTO:
            if key not in fill:
                raise DeepSpeedConfigError(
                    f"scheduler.params.{key}=\"auto\" in the DeepSpeed JSON: asyncrlhf has nothing to fill "
                    f"it from (it fills {sorted(fill)}); give it a value.")
            params[key] = fill[key]


def log_overrides(user: UserDeepSpeed) -> None:
    for line in user.overrides:
        log.warning("DeepSpeed JSON %s: %s", user.learner.deepspeed.config_file, line)

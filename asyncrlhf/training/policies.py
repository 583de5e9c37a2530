"""The learner's models as DeepSpeed engines: the policy, the frozen reference and the value model, as the
objective needs them.

With LoRA the reference is the policy's own base model (adapters disabled), so it costs no second copy; a
full fine-tune keeps a frozen copy on the policy's device.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

from asyncrlhf.config import Config, ModelConfig, PPOLearnerConfig
from asyncrlhf.model_sources import named_model
from asyncrlhf.models import ReferencePolicy, load_policy, load_score_model, load_tokenizer
from asyncrlhf.training import engine
from asyncrlhf.training.objectives import Objective

if TYPE_CHECKING:
    from deepspeed import DeepSpeedEngine


@dataclass
class LearnerModels:
    policy: DeepSpeedEngine
    reference: ReferencePolicy | None
    value: DeepSpeedEngine | None  # the value model (PPO), or None


def build_models(cfg: Config, objective: Objective) -> LearnerModels:
    lc = cfg.learner
    policy = load_policy(cfg.model, lora=lc.lora)
    frozen_base = None if lc.lora.enabled or not objective.needs_reference else load_policy(cfg.model)
    policy_engine = engine.initialize(policy, lc)
    reference = None
    if objective.needs_reference:
        base = policy_engine.module if frozen_base is None else frozen_base.to(policy_engine.device)
        reference = ReferencePolicy(base)
    value_engine = None
    if objective.needs_values:
        value_engine = engine.initialize(load_score_model(value_source(cfg)), lc)
    return LearnerModels(policy_engine, reference, value_engine)


def check_same_tokenizer(policy: ModelConfig, reward_model: ModelConfig) -> None:
    """The value model reads the policy's token ids: a reward model with another vocabulary cannot start it.
    (The reward *scorer* itself re-tokenises text with its own tokenizer, so any RM can score.)"""
    mine, theirs = load_tokenizer(policy).get_vocab(), load_tokenizer(reward_model).get_vocab()
    if mine != theirs:
        raise ValueError(
            f"learner.ppo.value_init=reward_model: the reward model {reward_model.name_or_path} has another "
            f"tokenizer than the policy {policy.name_or_path} (vocabularies of {len(theirs)} and {len(mine)} "
            "tokens differ), and the value model reads the policy's token ids; set "
            "learner.ppo.value_init=policy")


def value_source(cfg: Config) -> ModelConfig:
    """What PPO's value model starts from: the policy (default) or the reward model's weights (found as the
    reward service finds them, at its revision; trained in the policy's dtype)."""
    lc = cfg.learner
    if isinstance(lc, PPOLearnerConfig) and lc.ppo.value_init == "reward_model":
        scorers = [s for s in cfg.reward.scorers if s.kind == "model"]
        if not scorers:
            raise ValueError(
                "learner.ppo.value_init=reward_model needs a reward scorer of kind `model` with a path"
            )
        source = named_model(scorers[0].path, cfg.model, revision=scorers[0].revision, dtype=cfg.model.dtype)
        check_same_tokenizer(cfg.model, source)
        return source
    return cfg.model

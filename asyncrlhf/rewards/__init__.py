"""Reward scorers: reward models, Python rules, remote OpenRLHF-compatible servers, language models as judges;
and their composition.

    reward = build_reward(cfg.reward)            # CompositeReward from config
    result = reward.score([Item(prompt, completion, ended_with_eos=True, completion_tokens=12)])
    result.scores, result.components             # B totals; named components, B values each

Each scorer's raw score is recorded as a component under its label: a rule's name (a file rule's function
name), `model`, `remote` or `judge`; repeated labels get `_2`, `_3`, ...
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING

from asyncrlhf.config import ModelConfig, RewardConfig, ScorerConfig
from asyncrlhf.rewards.base import (
    CompositeReward,
    Item,
    Scorer,
    ScorerConfigError,
    ScorerError,
    ScoreResult,
    WeightedScorer,
)
from asyncrlhf.rewards.rules import RULES, RuleScorer, resolve_rule, rule

if TYPE_CHECKING:
    from asyncrlhf.rewards.judge import JudgeMeter

JudgeMeters = Callable[[str], "JudgeMeter"]  # scorer label -> where that judge reports

__all__ = [
    "RULES",
    "CompositeReward",
    "Item",
    "RuleScorer",
    "ScoreResult",
    "Scorer",
    "ScorerConfigError",
    "ScorerError",
    "WeightedScorer",
    "build_reward",
    "build_scorer",
    "resolve_rule",
    "rule",
]


def build_scorer(sc: ScorerConfig, cfg: RewardConfig, model: ModelConfig | None = None,
                 meter: JudgeMeter | None = None) -> Scorer:
    """One scorer from its config entry (a model, or a judge's engine, loads here). `model`: the run's
    policy settings, which a model by name shares (the hub switch, the GGUF cache); None: local models only.
    `meter`: where a judge reports its calls."""
    if sc.kind == "judge":
        from asyncrlhf.rewards.judge import Judge, JudgeScorer  # an engine only when a judge is used

        return JudgeScorer(Judge.from_config(sc, meter=meter), sc.parse_fail_reward)
    if sc.kind == "rule":
        return RuleScorer(sc.name, sc.args)
    if sc.kind == "model":
        from asyncrlhf.model_sources import named_model
        from asyncrlhf.models import resolve_device, resolve_dtype  # torch: only for a model
        from asyncrlhf.rewards.model import ModelScorer

        device = resolve_device(cfg.device)
        rm = named_model(sc.path, model or ModelConfig(), revision=sc.revision,
                         dtype=resolve_dtype(sc.dtype, device))
        return ModelScorer(rm, batch_size=cfg.batch_size, max_length=cfg.max_length, device=str(device))
    from asyncrlhf.rewards.remote import RemoteScorer

    return RemoteScorer(sc.url, timeout_s=cfg.timeout_s, retries=cfg.retries, token=sc.token)


def scorer_label(sc: ScorerConfig) -> str:
    if sc.kind == "rule":
        return sc.name.rsplit(":", 1)[-1]
    return sc.kind


def build_reward(cfg: RewardConfig, model: ModelConfig | None = None,
                 judge_meters: JudgeMeters | None = None) -> CompositeReward:
    """The service's reward: every configured scorer, weighted, plus the missing-EOS penalty. `model`: the
    run's policy settings (`build_scorer`). A judge reports its calls to `judge_meters(label)` (the reward
    service's metrics), when given."""
    weighted, seen = [], dict[str, int]()
    for sc in cfg.scorers:
        base = scorer_label(sc)
        seen[base] = seen.get(base, 0) + 1
        label = base if seen[base] == 1 else f"{base}_{seen[base]}"
        meter = judge_meters(label) if judge_meters is not None and sc.kind == "judge" else None
        weighted.append(WeightedScorer(label, sc.weight, build_scorer(sc, cfg, model, meter)))
    return CompositeReward(weighted, cfg.missing_eos_penalty, cfg.max_completion_tokens)

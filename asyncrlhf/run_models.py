"""Every model a run's services load by name, with the config key that names it: the policy (the reference
is its base or a copy of it), each reward model (PPO's value model may start from the first), and the
evaluator's gold model. `asyncrlhf up` finds them all before any service starts: a hub model is fetched once
(not by several services at the same time), and one that cannot be found stops the run naming its key.

A scorer kind that loads a model by name says which in `scorer_model`: a `judge` scorer's model belongs
there too.
"""

from __future__ import annotations

from dataclasses import dataclass

from asyncrlhf.config import Config, ModelConfig, ScorerConfig
from asyncrlhf.models import named_model


@dataclass(frozen=True)
class RunModel:
    """One model a run loads: the key that names it (`reward.scorers[0].path`) and where to find it."""

    key: str
    model: ModelConfig


def scorer_model(sc: ScorerConfig, run: ModelConfig) -> ModelConfig | None:
    """The model a scorer loads by name (its dtype is set where it loads: it depends on the device), or None
    for a scorer that loads none (a rule, a remote server)."""
    if sc.kind == "model":
        return named_model(sc.path, run, revision=sc.revision)
    return None


def run_models(cfg: Config) -> list[RunModel]:
    """The models `up` starts services with: the policy, the reward scorers', and the evaluator's gold (when
    the evaluator runs)."""
    found = [RunModel("model.name_or_path", cfg.model)]
    for i, sc in enumerate(cfg.reward.scorers):
        model = scorer_model(sc, cfg.model)
        if model is not None:
            found.append(RunModel(f"reward.scorers[{i}].path", model))
    gold = scorer_model(cfg.evaluator.gold, cfg.model) if cfg.launch.evaluator else None
    if gold is not None:
        found.append(RunModel("evaluator.gold.path", gold))
    return found

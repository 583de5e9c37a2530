"""Every model a run's services load by name, with the config key that names it: the policy (the reference
is its base or a copy of it), each reward model (PPO's value model may start from the first), and the
evaluator's gold model. `asyncrlhf up` finds them all before any service starts: a hub model is fetched once
(not by several services at the same time), and one that cannot be found stops the run naming its key.

A scorer kind that loads a model by name says which in `scorer_model`, with the key that names it: a reward
model's `path`, a judge's `model.name_or_path` (none for a judge behind an endpoint, whose model is the
server's).
"""

from __future__ import annotations

from dataclasses import dataclass

from asyncrlhf.config import Config, ModelConfig, ScorerConfig
from asyncrlhf.model_sources import named_model


@dataclass(frozen=True)
class RunModel:
    """One model a run loads: the key that names it (`reward.scorers[0].path`) and where to find it."""

    key: str
    model: ModelConfig


def scorer_model(sc: ScorerConfig, run: ModelConfig) -> tuple[str, ModelConfig] | None:
    """The key naming the model a scorer loads by name, relative to the scorer (`path`), and the model (its
    dtype is set where it loads: it depends on the device); None for a scorer that loads none (a rule, a
    remote server, a judge behind an endpoint)."""
    if sc.kind == "model":
        return "path", named_model(sc.path, run, revision=sc.revision)
    if sc.kind == "judge" and not sc.remote:
        return "model.name_or_path", sc.model
    return None


def run_models(cfg: Config) -> list[RunModel]:
    """The models `up` starts services with: the policy, the reward scorers' (a judge's too), and the
    evaluator's gold and judge (when the evaluator runs)."""
    scorers: list[tuple[str, ScorerConfig]] = [(f"reward.scorers[{i}]", sc)
                                                for i, sc in enumerate(cfg.reward.scorers)]
    if cfg.launch.evaluator:
        scorers.append(("evaluator.gold", cfg.evaluator.gold))
    found = [RunModel("model.name_or_path", cfg.model)]
    for where, sc in scorers:
        named = scorer_model(sc, cfg.model)
        if named is not None:
            found.append(RunModel(f"{where}.{named[0]}", named[1]))
    judge = cfg.evaluator.judge
    if cfg.launch.evaluator and judge is not None and not judge.remote:
        found.append(RunModel("evaluator.judge.model.name_or_path", judge.model))
    return found

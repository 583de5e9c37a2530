"""The scorer interface, what a scorer returns, and how scorers compose into one reward.

A scorer maps B (prompt, completion) texts to B scores, plus optional named components (B each):

    score(prompts, completions, labels=None) -> ScoreResult(scores, components, truncated)

`labels` are per-item reference answers (OpenRLHF's `labels`) for verifiable rewards; most scorers ignore
them.

`CompositeReward` is what the service runs: the weighted sum of its scorers, then the missing-EOS penalty
(`asyncrlhf.algorithms.missing_eos_penalty`) for completions that stopped at the length limit or are longer
than `reward.max_completion_tokens`. Components recorded per sample: each scorer's raw score under its
label (sub-components as `label.sub`), and `missing_eos` (1.0 where the penalty replaced the sum, else 0.0).
"""

from __future__ import annotations

import math
import threading
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Protocol

import torch

from asyncrlhf.algorithms import missing_eos_penalty


class ScorerError(RuntimeError):
    """A scorer could not score a batch (bad output, remote failure, model error); retrying may help."""


class ScorerConfigError(ValueError):
    """A scorer is misconfigured (unknown rule, missing file, no url); the message says what to change."""


@dataclass
class ScoreResult:
    """B scores, and named components of B values each. `truncated`: model inputs cut to fit."""

    scores: list[float]
    components: dict[str, list[float]] = field(default_factory=dict)
    truncated: int = 0

    def check(self, n: int, who: str) -> ScoreResult:
        """Raise ScorerError unless every list has `n` finite floats."""
        for name, values in {"scores": self.scores, **self.components}.items():
            if len(values) != n:
                raise ScorerError(f"{who} returned {len(values)} {name} for {n} completions")
            bad = [v for v in values if not math.isfinite(v)]
            if bad:
                raise ScorerError(f"{who} returned non-finite {name}: {bad[:3]}")
        return self


class Scorer(Protocol):
    """Anything that scores completions: a reward model, a rule, a remote server, a language model judge."""

    def score(
        self, prompts: Sequence[str], completions: Sequence[str], labels: Sequence[str] | None = None
    ) -> ScoreResult: ...


@dataclass(frozen=True)
class Item:
    """One completion to score. `ended_with_eos`: the generator stopped on EOS (finish reason stop)."""

    prompt: str
    completion: str
    ended_with_eos: bool = True
    completion_tokens: int | None = None
    label: str | None = None


@dataclass(frozen=True)
class WeightedScorer:
    label: str  # component name, unique within a CompositeReward
    weight: float
    scorer: Scorer


class CompositeReward:
    """Weighted sum of scorers plus the missing-EOS penalty and length limit. Thread-safe (one call at a
    time), so the consumer loop and the HTTP routes can share one model."""

    def __init__(
        self,
        scorers: Sequence[WeightedScorer],
        missing_eos_penalty: float | None = None,
        max_completion_tokens: int | None = None,
    ):
        labels = [s.label for s in scorers]
        if len(set(labels)) != len(labels):  # none: an episode task's reward is its environment's alone
            raise ScorerConfigError(f"scorers need unique labels; got {labels}")
        self.scorers = list(scorers)
        self.penalty = missing_eos_penalty
        self.max_completion_tokens = max_completion_tokens
        self._lock = threading.Lock()

    def score(self, items: Sequence[Item]) -> ScoreResult:
        if not items:
            return ScoreResult([], {s.label: [] for s in self.scorers})
        prompts = [it.prompt for it in items]
        completions = [it.completion for it in items]
        labels = [it.label or "" for it in items] if any(it.label for it in items) else None
        total = torch.zeros(len(items), dtype=torch.float64)
        components: dict[str, list[float]] = {}
        truncated = 0
        with self._lock:
            for ws in self.scorers:
                result = ws.scorer.score(prompts, completions, labels).check(
                    len(items), f"scorer `{ws.label}`"
                )
                total += ws.weight * torch.tensor(result.scores, dtype=torch.float64)
                components[ws.label] = [float(v) for v in result.scores]
                components.update(
                    {f"{ws.label}.{k}": [float(v) for v in vs] for k, vs in result.components.items()}
                )
                truncated += result.truncated
        if self.penalty is not None:
            ended = torch.tensor([self._ended(it) for it in items])
            total = missing_eos_penalty(total, ended, self.penalty)
            components["missing_eos"] = [0.0 if e else 1.0 for e in ended.tolist()]
        return ScoreResult(total.tolist(), components, truncated)

    def _ended(self, item: Item) -> bool:
        too_long = (
            self.max_completion_tokens is not None
            and item.completion_tokens is not None
            and item.completion_tokens > self.max_completion_tokens
        )
        return item.ended_with_eos and not too_long

"""The judged win rate (`evaluator.judge`): a pairwise judge compares each held-out answer of a policy with
the reference answer of the same prompt, in both orders (the policy's shown first, then second), so a judge
that favours a position favours neither side.

Per prompt, the judge's preference for the policy's answer is the mean of both orders
(`asyncrlhf.algorithms.judged_preference`); the win rate is its mean over prompts (ties, 0.5, count half:
identical answers tie), with a percentile bootstrap interval over prompts. Prompts where neither order's
reply parsed are left out and counted. A judge that gives no reply (an endpoint down) leaves this
version's judged figures empty and says so: the gold evaluation goes on.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from typing import Any

import torch

from asyncrlhf import algorithms as A
from asyncrlhf.config import EvaluatorJudgeConfig
from asyncrlhf.rewards.base import ScorerError
from asyncrlhf.rewards.judge import Judge

log = logging.getLogger(__name__)
EMPTY = {"judged_win_rate": None, "judged_win_rate_low": None, "judged_win_rate_high": None,
         "judged_ties": None, "judged_unparsed": None}


class JudgedWinRate:
    def __init__(self, cfg: EvaluatorJudgeConfig, seed: int = 0, judge: Judge | None = None):
        self.cfg, self.seed = cfg, seed
        self.judge = judge or Judge.from_config(cfg, seed)

    def measure(self, prompts: Sequence[str], answers: Sequence[str], references: Sequence[str],
                labels: Sequence[str | None] | None = None) -> dict[str, Any]:
        """judged_win_rate (+ _low, _high: the interval), judged_ties (share of prompts at 0.5) and
        judged_unparsed (prompts without a parsed reply) of `answers` against `references`."""
        n = len(prompts)
        given = list(labels) if labels is not None and len(labels) == n else [None] * n
        first = [{"prompt": p, "completion_a": a, "completion_b": r, "reference": g or ""}
                 for p, a, r, g in zip(prompts, answers, references, given, strict=True)]
        second = [{**q, "completion_a": q["completion_b"], "completion_b": q["completion_a"]} for q in first]
        try:
            values = self.judge.values(first + second)
        except ScorerError as err:
            log.warning("the evaluator's judge gave no reply (%s): no judged win rate for this version", err)
            return dict(EMPTY)
        return self._summary(values[:n], values[n:])

    def _summary(self, first: list[float | None], second: list[float | None]) -> dict[str, Any]:
        def tensors(values: list[float | None]) -> tuple[torch.Tensor, torch.Tensor]:
            return (torch.tensor([0.0 if v is None else v for v in values], dtype=torch.float64),
                    torch.tensor([v is not None for v in values]))

        (shown_first, parsed_first), (shown_second, parsed_second) = tensors(first), tensors(second)
        preference = A.judged_preference(shown_first, shown_second, parsed_first, parsed_second)
        counted = preference[~preference.isnan()]
        if counted.numel() == 0:
            return {**EMPTY, "judged_unparsed": len(first)}
        low, high = A.bootstrap_interval(counted, self.cfg.bootstrap_samples, self.cfg.confidence, self.seed)
        return {"judged_win_rate": float(counted.mean()), "judged_win_rate_low": low,
                "judged_win_rate_high": high, "judged_ties": float((counted == 0.5).double().mean()),
                "judged_unparsed": len(first) - counted.numel()}

    def close(self) -> None:
        self.judge.close()


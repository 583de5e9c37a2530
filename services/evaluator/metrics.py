"""The evaluator's Prometheus metrics (names: `asyncrlhf_evaluator_<what>_<unit>`)."""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

from asyncrlhf import metrics as names
from asyncrlhf.stalls import WaitState

EVAL_BUCKETS = (1, 2, 5, 10, 20, 30, 60, 120, 300, 600, 1200)


class EvaluatorMetrics:
    def __init__(self) -> None:
        r = self.registry = CollectorRegistry()
        self.gold_reward = Gauge(
            names.EVALUATOR_GOLD_REWARD, "Mean gold reward of the last evaluated policy.", registry=r
        )
        self.win_rate = Gauge(
            names.EVALUATOR_WIN_RATE, "Win rate against the reference completions (ties half).", registry=r
        )
        self.kl = Gauge(
            names.EVALUATOR_KL, "Mean summed log-ratio to the reference policy (nats).", registry=r
        )
        self.perplexity = Gauge(
            names.EVALUATOR_PERPLEXITY, "Reference-policy perplexity of the completions.", registry=r
        )
        self.judged_win_rate = Gauge(
            names.EVALUATOR_JUDGED_WIN_RATE,
            "Judged win rate against the reference answers (evaluator.judge: both orders, ties half), "
            "its estimate and its bootstrap interval's bounds.",
            ["bound"],
            registry=r,
        )
        self.version = Gauge(names.EVALUATOR_VERSION, "Policy version last evaluated.", registry=r)
        self.evaluations = Counter(
            names.EVALUATOR_EVALUATIONS_TOTAL, "Policy versions evaluated.", registry=r
        )
        self.eval_time = Histogram(
            names.EVALUATOR_EVAL_SECONDS,
            "Time to evaluate one policy version.",
            buckets=EVAL_BUCKETS,
            registry=r,
        )
        self.skipped = Counter(
            names.EVALUATOR_SKIPPED_CHECKPOINTS_TOTAL,
            "Checkpoint events not evaluated, by reason.",
            ["reason"],
            registry=r,
        )
        self.waiting = WaitState(Gauge(
            names.EVALUATOR_WAITING_SINCE_SECONDS,
            "Unix time the wait began, by what it waits on (checkpoints); none while evaluating.",
            ["on"],
            registry=r,
        ))

    def record(self, row: dict) -> None:
        self.gold_reward.set(row["gold_reward"])
        self.win_rate.set(row["win_rate"])
        self.kl.set(row["kl"])
        self.perplexity.set(row["perplexity"])
        self.version.set(row["version"])
        for bound, key in (("estimate", "judged_win_rate"), ("low", "judged_win_rate_low"),
                           ("high", "judged_win_rate_high")):
            if row.get(key) is not None:
                self.judged_win_rate.labels(bound).set(row[key])
        self.evaluations.inc()

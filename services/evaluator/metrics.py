"""The evaluator's Prometheus metrics (names: `asyncrlhf_evaluator_<what>_<unit>`)."""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

from asyncrlhf.metrics import metric_name as n

EVAL_BUCKETS = (1, 2, 5, 10, 20, 30, 60, 120, 300, 600, 1200)


class EvaluatorMetrics:
    def __init__(self) -> None:
        r = self.registry = CollectorRegistry()
        self.gold_reward = Gauge(
            n("evaluator", "gold_reward"), "Mean gold reward of the last evaluated policy.", registry=r
        )
        self.win_rate = Gauge(
            n("evaluator", "win_rate"), "Win rate against the reference completions (ties half).", registry=r
        )
        self.kl = Gauge(
            n("evaluator", "kl"), "Mean summed log-ratio to the reference policy (nats).", registry=r
        )
        self.perplexity = Gauge(
            n("evaluator", "perplexity"), "Reference-policy perplexity of the completions.", registry=r
        )
        self.version = Gauge(n("evaluator", "version"), "Policy version last evaluated.", registry=r)
        self.evaluations = Counter(
            n("evaluator", "evaluations", "total"), "Policy versions evaluated.", registry=r
        )
        self.eval_time = Histogram(
            n("evaluator", "eval", "seconds"),
            "Time to evaluate one policy version.",
            buckets=EVAL_BUCKETS,
            registry=r,
        )
        self.skipped = Counter(
            n("evaluator", "skipped_checkpoints", "total"),
            "Checkpoint events not evaluated, by reason.",
            ["reason"],
            registry=r,
        )

    def record(self, row: dict) -> None:
        self.gold_reward.set(row["gold_reward"])
        self.win_rate.set(row["win_rate"])
        self.kl.set(row["kl"])
        self.perplexity.set(row["perplexity"])
        self.version.set(row["version"])
        self.evaluations.inc()

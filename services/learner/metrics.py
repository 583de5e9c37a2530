"""The learner's Prometheus metrics (names: `asyncrlhf_learner_<what>_<unit>`)."""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

from asyncrlhf.metrics import metric_name as n
from asyncrlhf.training.batch import TrainGroup

STALENESS_BUCKETS = (0, 1, 2, 3, 4, 6, 8, 12, 16)


class LearnerMetrics:
    def __init__(self) -> None:
        r = self.registry = CollectorRegistry()
        self.version = Gauge(n("learner", "version"), "Policy version the learner holds (steps + 1).", registry=r)
        self.steps = Counter(n("learner", "steps", "total"), "Optimizer steps taken.", registry=r)
        self.samples = Counter(n("learner", "samples", "total"), "Sequences trained on.", registry=r)
        self.tokens = Counter(n("learner", "tokens", "total"), "Completion tokens trained on.", registry=r)
        self.groups = Counter(n("learner", "groups", "total"), "Prompt groups consumed, by outcome.", ["outcome"],
                              registry=r)
        self.loss = Gauge(n("learner", "loss"), "Loss of the last step.", registry=r)
        self.kl = Gauge(n("learner", "kl"), "Mean sequence KL to the reference, last step.", registry=r)
        self.reward = Gauge(n("learner", "reward_mean"), "Mean reward of the last step's samples.", registry=r)
        self.stat = Gauge(n("learner", "step_stat"), "Per-algorithm statistics of the last step.", ["stat"],
                          registry=r)
        self.staleness = Histogram(n("learner", "staleness_versions"), "Staleness of trained samples, in versions.",
                                   buckets=STALENESS_BUCKETS, registry=r)
        self.stale = Counter(n("learner", "stale_groups", "total"), "Groups beyond max_staleness, by action.",
                             ["action"], registry=r)
        self.wait = Counter(n("learner", "wait_seconds", "total"), "Time spent waiting for scored groups.",
                            registry=r)
        self.step_time = Histogram(n("learner", "step_seconds"), "Time of one training step (no waiting).",
                                   registry=r)
        self.push_time = Gauge(n("learner", "push_seconds"), "Duration of the last weight push, per target.",
                               ["target"], registry=r)
        self.push_bytes = Counter(n("learner", "push_bytes", "total"), "Bytes pushed, per target.", ["target"],
                                  registry=r)
        self.push_failures = Counter(n("learner", "push_failures", "total"), "Failed pushes, per target and status.",
                                     ["target", "status"], registry=r)
        self.in_flight = Gauge(n("learner", "in_flight_groups"), "Prompt groups enqueued, not yet finished.",
                               registry=r)
        self.queue_depth = Gauge(n("learner", "queue_depth"), "Entries waiting in each stream.", ["stream"],
                                 registry=r)
        self.queue_lag = Gauge(n("learner", "consumer_lag"), "Entries not yet delivered to each stream's group.",
                               ["stream"], registry=r)
        self.dead_letters = Gauge(n("learner", "dead_letter_entries"), "Entries in the run's dead-letter stream.",
                                  registry=r)

    def record_step(self, stats: dict[str, float], groups: list[TrainGroup], version: int) -> None:
        """A trained step: `version` is the one its update produced; staleness is per sample."""
        self.version.set(version)
        self.steps.inc()
        self.samples.inc(stats.get("sequences", 0))
        self.tokens.inc(stats.get("tokens", 0))
        self.groups.labels("trained").inc(len(groups))
        self.reward.set(stats["reward_mean"])
        if "loss" in stats:
            self.loss.set(stats["loss"])
        if "kl" in stats:
            self.kl.set(stats["kl"])
        for key, value in stats.items():
            self.stat.labels(key).set(value)
        for g in groups:
            for _ in g.message.samples:
                self.staleness.observe(g.decision.staleness)

"""The generator's Prometheus metrics, in a registry of their own (several generators can share a process)."""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

from asyncrlhf.metrics import metric_name

SERVICE = "generator"
_SECONDS_BUCKETS = (0.01, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120, 300)


class GeneratorMetrics:
    """Tokens/s is `rate(asyncrlhf_generator_tokens_total[1m])`; the gauge gives the last batch's rate."""

    def __init__(self, generator_id: str, registry: CollectorRegistry | None = None):
        self.registry = registry or CollectorRegistry()
        r, name = self.registry, lambda what, unit=None: metric_name(SERVICE, what, unit)
        self.tokens = Counter(name("tokens", "total"), "Completion tokens generated.", registry=r)
        self.groups = Counter(name("groups", "total"), "Rollout groups written.", registry=r)
        self.failed_groups = Counter(name("failed_groups", "total"),
                                     "Prompt groups whose batch failed (retried, then dead-lettered).",
                                     registry=r)
        self.tokens_per_second = Gauge(name("tokens_per_second"), "Tokens/s of the last batch.", registry=r)
        self.batch_seconds = Histogram(name("batch", "seconds"), "Seconds per generation batch.",
                                       buckets=_SECONDS_BUCKETS, registry=r)
        self.idle_seconds = Counter(name("idle_seconds", "total"),
                                    "Seconds with nothing to generate (no prompts, or no weights yet).",
                                    registry=r)
        self.version = Gauge(name("policy_version"), "Policy version served.", ["generator"],
                             registry=r).labels(generator=generator_id)
        self.weight_apply_seconds = Histogram(
            name("weight_apply", "seconds"),
            "Seconds to swap a pushed version in (waiting for the batch included).",
            buckets=_SECONDS_BUCKETS, registry=r)
        self.weight_updates = Counter(name("weight_updates", "total"), "Weight versions applied.", registry=r)
        self.prompts_pending = Gauge(name("prompts_pending"), "Prompt groups waiting in the prompts stream.",
                                     registry=r)

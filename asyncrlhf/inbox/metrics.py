"""The metrics the inbox records, as the learner service's registry provides them (names and help texts
live with the service's `LearnerMetrics`; `asyncrlhf.metrics` owns the names)."""

from __future__ import annotations

from typing import Protocol

from prometheus_client import Counter, Gauge, Histogram

from asyncrlhf._proto.rollout_pb2 import RolloutGroup
from asyncrlhf.algorithms import StalenessDecision

_STALE_LABELS = {"keep": "kept", "correct": "corrected", "drop": "dropped"}


class InboxMetrics(Protocol):
    groups: Counter  # groups ended, by outcome
    stale: Counter  # groups beyond max_staleness, by action
    sample_tokens: Histogram  # completion tokens per sample, by stage (generated: judged on staleness)
    old_lineage: Counter  # groups sampled by an older lineage's weights, by action
    requeued: Counter  # groups enqueued again, by reason
    filtered: Counter  # groups filtered by dynamic sampling, by reason
    wait: Counter  # seconds waiting for scored groups
    in_flight: Gauge
    queue_depth: Gauge
    queue_lag: Gauge
    dead_letters: Gauge
    lineage: Gauge


def record_judged(metrics: InboxMetrics, decision: StalenessDecision, old_lineage: bool,
                  group: RolloutGroup) -> None:
    """A group judged on staleness: its action when beyond the bound (and by an older lineage), and its
    samples' lengths as generated, which `sample_tokens{stage="trained"}` is compared with."""
    if decision.action != "fresh":
        label = _STALE_LABELS[decision.action]
        metrics.stale.labels(label).inc()
        if old_lineage:
            metrics.old_lineage.labels(label).inc()
    for sample in group.samples:
        metrics.sample_tokens.labels("generated").observe(len(sample.completion_token_ids))

"""The metrics the inbox records, as the learner service's registry provides them (names and help texts
live with the service's `LearnerMetrics`; `asyncrlhf.metrics` owns the names)."""

from __future__ import annotations

from typing import Protocol

from prometheus_client import Counter, Gauge, Histogram


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

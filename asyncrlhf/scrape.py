"""One scrape of every service's /metrics, as the progress display of `asyncrlhf up` and its stall monitor
read it: unlabelled samples per service, each generator's version, each service's wait, the queue depths."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Protocol

import httpx
from prometheus_client.parser import text_string_to_metric_families

from asyncrlhf import metrics as names

WAITING_SINCE = frozenset({names.GENERATOR_WAITING_SINCE_SECONDS, names.REWARD_WAITING_SINCE_SECONDS,
                           names.LEARNER_WAITING_SINCE_SECONDS, names.EVALUATOR_WAITING_SINCE_SECONDS})


class Scrapeable(Protocol):
    """A service with a /metrics endpoint (`asyncrlhf.processes.Service`)."""

    @property
    def name(self) -> str: ...

    @property
    def url(self) -> str: ...


@dataclass
class Snapshot:
    """What the progress display shows, scraped from every service's /metrics."""

    values: dict[str, float] = field(default_factory=dict)  # unlabelled samples, summed over services
    generator_versions: dict[str, float] = field(default_factory=dict)
    answered: dict[str, bool] = field(default_factory=dict)
    per_service: dict[str, dict[str, float]] = field(default_factory=dict)  # unlabelled samples per service
    waiting: dict[str, tuple[str, float]] = field(default_factory=dict)  # what each waits on, since when


def scrape(services: Sequence[Scrapeable], timeout_s: float = 2.0) -> Snapshot:
    snap = Snapshot()
    with httpx.Client(timeout=timeout_s) as http:
        for svc in services:
            try:
                text = http.get(f"{svc.url}/metrics").text
            except httpx.HTTPError:
                snap.answered[svc.name] = False
                continue
            snap.answered[svc.name] = True
            read_exposition(text, svc.name, snap)
    return snap


def read_exposition(text: str, service: str, snap: Snapshot) -> None:
    """One service's /metrics text into the snapshot."""
    own = snap.per_service.setdefault(service, {})
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            if sample.name == names.GENERATOR_POLICY_VERSION:
                snap.generator_versions[service] = sample.value
            elif sample.name in WAITING_SINCE:
                snap.waiting[service] = (sample.labels["on"], sample.value)
            elif not sample.labels:
                own[sample.name] = sample.value
                snap.values[sample.name] = snap.values.get(sample.name, 0.0) + sample.value
            elif sample.name == names.LEARNER_QUEUE_DEPTH:
                snap.values[f"queue:{sample.labels['stream']}"] = sample.value
            elif family.type == "histogram" and sample.name.endswith(("_sum", "_count")):
                own[sample.name] = own.get(sample.name, 0.0) + sample.value  # over its labels

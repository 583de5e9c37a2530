"""The CPU each test costs, printed at the end of every run beside pytest's durations (`--durations`).

On 2 cores with 2 workers the suite keeps both cores busy, so its length is the CPU its tests spend, and a
test's duration says how long it waited as much as what it cost: `bench pipeline` took 146 s beside the
compose build and 30 s alone, for the same 32 CPU-s. Here a test's CPU is its worker's, from its setup to
its teardown, and that of every process the worker waited for in that time (the services, engines and
commands the test started, and what they waited for in turn: `getrusage(RUSAGE_CHILDREN)`). What no test
process waits for is not counted: the Docker engine's builds, a server a fixture of wider scope started
(counted where that fixture is torn down).

Each test's figure is a user property (`cpu_s`: the JUnit XML has it per test case) and the costliest are
listed at the end of the run (`CPU_LISTED`).
"""

from __future__ import annotations

import resource
from typing import Any

CPU_LISTED = 25
PROPERTY = "cpu_s"


def spent() -> float:
    """CPU seconds of this process and of the processes it has waited for, so far."""
    ours, waited = resource.getrusage(resource.RUSAGE_SELF), resource.getrusage(resource.RUSAGE_CHILDREN)
    return ours.ru_utime + ours.ru_stime + waited.ru_utime + waited.ru_stime


def costliest(reports: list[Any], n: int = CPU_LISTED) -> list[tuple[float, str]]:
    """The `n` highest `cpu_s` among the teardown reports (one per test), highest first."""
    costs = [(value, r.nodeid) for r in reports if r.when == "teardown"
             for key, value in r.user_properties if key == PROPERTY]
    return sorted(costs, reverse=True)[:n]


def summary(reports: list[Any]) -> list[str]:
    """The lines printed at the end of the run: the total, then the costliest tests."""
    every = costliest(reports, n=len(reports))
    if not every:
        return []
    lines = [f"{sum(cpu for cpu, _ in every):.0f} CPU-s in {len(every)} tests (the test's worker and the "
             f"processes it waited for); the costliest {min(CPU_LISTED, len(every))}:"]
    return lines + [f"{cpu:8.1f} CPU-s  {nodeid}" for cpu, nodeid in every[:CPU_LISTED]]

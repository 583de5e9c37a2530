"""A service's wait: set, kept while unchanged, restored after a nested wait, mirrored into its gauge."""

import pytest
from prometheus_client import CollectorRegistry, Gauge

from asyncrlhf.stalls import Wait, Waiting, WaitState

pytestmark = pytest.mark.unit


class Clock:
    now = 100.0

    def __call__(self):
        return self.now


def series(registry: CollectorRegistry) -> dict[str, float]:
    return {s.labels["on"]: s.value for m in registry.collect() for s in m.samples}


def test_a_wait_keeps_its_start_until_it_changes_and_the_gauge_shows_one_series():
    registry, clock = CollectorRegistry(), Clock()
    state = WaitState(Gauge("x_waiting_since_seconds", "h", ["on"], registry=registry), clock)
    state.wait(Wait.PROMPTS)
    clock.now = 105.0
    state.wait(Wait.PROMPTS)  # still the same wait: it began at 100
    assert state.current == Waiting(Wait.PROMPTS, 100.0)
    assert series(registry) == {"prompts": 100.0}
    state.work()
    assert state.current is None and series(registry) == {}


def test_a_nested_wait_returns_to_the_one_it_interrupted():
    clock = Clock()
    state = WaitState(clock=clock)
    state.wait(Wait.SCORED_GROUPS)
    clock.now = 110.0
    with state.waiting(Wait.PUSH, "gen-b"):
        assert state.current == Waiting(Wait.PUSH, 110.0, "gen-b")
    assert state.current == Waiting(Wait.SCORED_GROUPS, 100.0)
    assert state.current.seconds(130.0) == 30.0

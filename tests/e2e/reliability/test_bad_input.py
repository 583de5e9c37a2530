"""Bad entries XADDed by hand into every stream of a live run: malformed, truncated, missing the payload,
oversized garbage, and well-formed but oversized messages. Each is dead-lettered with a reason, no service
stops, training goes on, and the audit still accounts for every real group (the hand-made ones are
reported apart and release no credit)."""

from __future__ import annotations

import pytest

from tests.e2e.reliability.bad_input import BAD_ENTRIES, inject_bad_entries
from tests.e2e.reliability.cluster import Cluster

pytestmark = pytest.mark.e2e


@pytest.fixture
def cluster(tmp_path):
    c = Cluster(tmp_path)
    yield c
    c.close()


@pytest.mark.slow  # CI runs the same step inside tests/e2e/reliability/test_faults.py
def test_bad_entries_in_every_stream_are_dead_lettered_and_nothing_stops(cluster):
    cluster.start_all(generators=1, rewards=1)
    cluster.wait_steps(1, "to start", timeout_s=300)
    inject_bad_entries(cluster)
    cluster.procs["learner"].stop()
    report = cluster.audit()
    assert report["ok"] and report["foreign_dead_letters"] == BAD_ENTRIES and report["dead_lettered"] == 0, (
        report
    )

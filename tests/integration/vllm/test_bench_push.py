"""`asyncrlhf bench generator --push` on the tiny model: every path it compares reaches the engine out of
process (the shared-memory handoff, a file, and the collective route received by the engine's worker), each
push committed, and the report names each figure."""

from __future__ import annotations

import pytest

from asyncrlhf.bench.enginepush import compare, report
from tests.integration.vllm.helpers import vllm_config

pytestmark = [pytest.mark.integration, pytest.mark.vllm]


def test_the_push_bench_times_every_path_into_an_engine_process(tmp_path):
    result = compare(vllm_config(tmp_path), repeats=1)
    assert {mode: len(t) for mode, t in result["times"].items()} == {"shm": 2, "file": 2, "collective": 2}
    assert all(s > 0 for t in result["times"].values() for s in t)
    assert result["collective_ratio"] == result["collective_step_to_serve_s"] / result["file_step_to_serve_s"]
    lines = report(result)
    assert any("collective, received by the engine's worker" in line for line in lines), lines

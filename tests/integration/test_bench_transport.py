"""`asyncrlhf bench transport` runs end to end at a small size (a smoke test; the numbers are not judged)."""

import json

import pytest

from asyncrlhf.bench.transport import main

pytestmark = pytest.mark.integration


def test_bench_transport_prints_every_figure(capsys):
    assert main(["--groups", "64", "--params", "3000000", "--relay-params", "1000000", "--repeats", "2",
                 "--json"]) == 0
    result = json.loads(capsys.readouterr().out)
    assert set(result) == {"groups_per_s", "bare_groups_per_s", "push_gbps", "stream_push_gbps",
                           "bare_grpc_gbps", "collective_push_gbps", "bare_gloo_gbps", "shm_push_gbps",
                           "memcpy_gbps", "two_generators_time_ratio", "step_to_serve_s",
                           "relay_learner_bytes_ratio", "relay_last_commit_s"}
    assert all(value > 0 for value in result.values())
    assert result["relay_learner_bytes_ratio"] <= 2  # 16 receivers, fanout 2: the learner streams to two


def test_bench_transport_needs_two_repeats():
    with pytest.raises(SystemExit):
        main(["--repeats", "1"])

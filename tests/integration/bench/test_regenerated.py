"""`asyncrlhf bench chaos --tokens`: tokens sampled twice = sampled - written - in flight at the end, from
the generators' own counters and what the run left in Redis (a real embedded Redis)."""

import pytest

from asyncrlhf._proto.rollout_pb2 import PromptGroup, Sample
from asyncrlhf.bench.regenerated import KillReading, TokenLedger, add_stopped, in_flight_tokens
from asyncrlhf.streams import PROMPTS, RunStreams

pytestmark = pytest.mark.integration


def test_a_killed_generators_unsaved_tokens_are_the_ones_sampled_twice():
    # A sampled 40 tokens of a sample, saved at 32, was killed; B continued from 32 and wrote the sample at
    # 92 tokens; C stopped cleanly with 10 tokens of another sample handed on (in flight at the end).
    ledger = TokenLedger(kills=[KillReading(sampled=40, written=0, running=2)])
    ledger.stopped_sampled, ledger.stopped_written = 60 + 10, 92
    ledger.in_flight_at_end = 10
    summary = ledger.summary(save_every_tokens=32)
    assert ledger.regenerated == 8
    assert summary["samples_in_flight_at_kills"] == 2 and summary["regenerated_per_sample_in_flight"] == 4.0


def test_the_stop_lines_of_every_generator_log_are_added(tmp_path):
    (tmp_path / "generator-0.log").write_text(
        "x generator stopped: 120 tokens sampled, 100 written in groups, 1 groups handed on\n"
        "y generator stopped: 30 tokens sampled, 30 written in groups, 0 groups handed on\n")
    (tmp_path / "generator-1.log").write_text("killed before it could say anything\n")
    (tmp_path / "learner.log").write_text("generator stopped: 999 tokens sampled, 0 written in groups\n")
    ledger = TokenLedger()
    add_stopped(ledger, tmp_path)
    assert (ledger.stopped_sampled, ledger.stopped_written) == (150, 130)


def test_in_flight_at_the_end_takes_the_further_of_a_handed_on_prompt_and_its_save(redis_client, run_name):
    from asyncrlhf.config import RedisConfig

    streams = RunStreams(redis_client, run_name, RedisConfig())
    prompts = streams.producer(PROMPTS)

    def group(gid, *lengths):
        samples = [Sample(completion_token_ids=[1] * n) for n in lengths]
        return PromptGroup(group_id=gid, partial_samples=samples)

    prompts.add(group("g00000000", 5, 7))  # handed on with 12 tokens; saved with 20 below: 20 count
    prompts.add(group("g00000001", 9))  # handed on, no save: 9
    prompts.add(group("g00000003"))  # never started: 0
    streams.partials().save([group("g00000000", 10, 10), group("g00000002", 33),  # a killed one's save: 33
                             group("g00000004", 50)])  # saved, but the group ended (trained): not in flight
    assert in_flight_tokens(redis_client, run_name, ended={"g00000004"}) == 20 + 9 + 33


def test_a_generators_counters_are_read_from_the_metrics_its_command_line_names(tmp_path):
    """read_before_kill: the port from the process's own command line, the counters from its /metrics."""
    import subprocess
    import sys
    import time

    from asyncrlhf import metrics as names
    from asyncrlhf.bench.regenerated import read_before_kill
    from asyncrlhf.redis_server import free_port

    port = free_port()
    body = (f"{names.GENERATOR_TOKENS_TOTAL} 120.0\n{names.GENERATOR_WRITTEN_TOKENS_TOTAL} 90.0\n"
            f"{names.GENERATOR_ENGINE_OCCUPANCY} 0.5\n")
    server = ("import http.server, sys\n"
              "class H(http.server.BaseHTTPRequestHandler):\n"
              "    def do_GET(self):\n"
              f"        body = {body!r}.encode()\n"
              "        self.send_response(200); self.end_headers(); self.wfile.write(body)\n"
              f"http.server.HTTPServer(('127.0.0.1', {port}), H).serve_forever()\n")
    proc = subprocess.Popen([sys.executable, "-c", server, f"generator.http_port={port}"])
    try:
        reading = None
        for _ in range(50):
            reading = read_before_kill(proc.pid, capacity=8)
            if reading is not None:
                break
            time.sleep(0.1)
        assert reading == KillReading(sampled=120.0, written=90.0, running=4.0)
    finally:
        proc.kill()
        proc.wait()
    assert read_before_kill(proc.pid, capacity=8) is None  # gone: not read, counted apart by the bench

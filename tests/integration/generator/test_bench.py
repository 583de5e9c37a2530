"""`asyncrlhf bench generator`: the generator service as its own process beside the bare backend call."""

import json
import os

import pytest

from asyncrlhf.bench.generator import main

pytestmark = pytest.mark.integration
TINY = ["--config", "configs/tiny.yaml", "--prompts", "8", "--repeats", "1", "generator.device=cpu"]


def test_bench_compares_service_and_bare_on_the_same_samples(capsys):
    assert main([*TINY, "--json"]) == 0
    result = json.loads(capsys.readouterr().out)
    (round_,) = result["rounds"]
    # same seed, thread count and batches on each side: the service process wrote exactly the tokens the
    # bare backend sampled in this one
    assert round_["service_tokens"] == round_["bare_tokens"] > 0
    assert result["bare_tokens_per_s"] > 0 and result["service_tokens_per_s"] > 0
    assert result["ratio"] == pytest.approx(result["service_tokens_per_s"] / result["bare_tokens_per_s"])
    assert result["threads"] >= 1


def test_api_requests_reach_the_service_before_the_timed_rounds(capsys):
    # the real `openai` client, several requests at once: each on a web server worker thread of its own
    assert main([*TINY, "--api-requests", "3", "--json"]) == 0
    result = json.loads(capsys.readouterr().out)
    assert result["api_requests"] == 3
    (round_,) = result["rounds"]
    # API traffic never shifts the loop's samples
    assert round_["service_tokens"] == round_["bare_tokens"] > 0


def test_a_negative_api_request_count_is_refused(capsys):
    with pytest.raises(SystemExit) as exit_:
        main([*TINY, "--api-requests", "-1"])
    assert exit_.value.code == 2 and "--api-requests must be 0 or more" in capsys.readouterr().err


def test_a_service_that_cannot_start_fails_the_bench_with_its_log():
    # the service refuses a non-loopback HTTP bind without a token; the bare side would run
    with pytest.raises(RuntimeError, match=r"did not register \(exited with 2\)[\s\S]*no auth token"):
        main([*TINY, "generator.http_host=0.0.0.0"])


def test_backends_side_by_side_print_tokens_per_s_and_first_token_latency(capsys):
    assert main([*TINY, "--backend", "hf"]) == 0
    out = capsys.readouterr().out
    assert "bare tok/s" in out and "first token" in out
    (row,) = [line for line in out.splitlines() if line.strip().startswith("hf ")]
    assert row.split()[1] == "cpu" and float(row.split()[2]) > 0 and row.rstrip().endswith(")")


def test_several_backends_are_each_measured_in_their_own_process(capsys):
    assert main([*TINY, "--backend", "hf", "--backend", "hf", "--json"]) == 0
    results = json.loads(capsys.readouterr().out)
    assert [r["backend"] for r in results] == ["hf", "hf"]
    assert all(r["bare_tokens_per_s"] > 0 and r["bare_first_token_s"] > 0 for r in results)


def test_the_service_starts_with_the_benchs_own_environment_not_what_an_engine_wrote_into_it(monkeypatch,
                                                                                           tmp_path):
    # the bare vLLM backend writes its workers' settings into os.environ (LD_PRELOAD, shared-memory buffer
    # names); a user's generator never starts with those, so the bench's must not either
    from asyncrlhf.bench.generator import GeneratorProcess
    from asyncrlhf.config import load_config

    monkeypatch.setenv("VLLM_OBJECT_STORAGE_SHM_BUFFER_NAME", "written-by-the-bare-engine")
    cfg = load_config(["configs/tiny.yaml"], ["redis.url=redis://127.0.0.1:1/0"])
    env = GeneratorProcess(cfg, ["configs/tiny.yaml"], [], 2, tmp_path / "log").process.env
    assert "VLLM_OBJECT_STORAGE_SHM_BUFFER_NAME" not in env
    assert env["OMP_NUM_THREADS"] == "2" and env["PATH"] == os.environ["PATH"]

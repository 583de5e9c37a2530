"""A SIGKILLed generator never leaves its vLLM engine running: with the engine in processes of its own (the
GPU default), `VLLM::EngineCore` and its `VLLM::Worker` end with the generator, so a restarted generator finds
the memory they held free. One generator start (about 30 s here: the engine's)."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from asyncrlhf.engine_lifetime import alive, descendants

pytestmark = [pytest.mark.integration, pytest.mark.vllm]
ROOT = Path(__file__).resolve().parents[3]


def names(processes) -> set[str]:
    """Their names as vLLM sets them (`VLLM::EngineCore`: the first word of the command line)."""
    out = set()
    for pid, _ in processes:
        try:
            out.add(Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")[0].decode(errors="replace").strip())
        except OSError:
            continue
    return out


def test_a_sigkilled_generator_takes_its_engine_processes_with_it(tmp_path, redis_url, run_name):
    log_path = tmp_path / "generator.log"
    cmd = [sys.executable, "-m", "services.generator", "--config", "configs/tiny.yaml",
           f"model.cache_dir={tmp_path}/cache", "model.tiny.heads=2", "generator.backend=vllm",
           "generator.vllm.engine_in_process=false", "generator.vllm.kv_cache_gib=1",
           f"redis.url={redis_url}", f"run.name={run_name}", f"run.dir={tmp_path}/run"]
    with log_path.open("w") as log:
        generator = subprocess.Popen(cmd, cwd=ROOT, stdout=log, stderr=subprocess.STDOUT,
                                     env={**os.environ, "PYTHONPATH": str(ROOT)})
    engine: list = []
    try:
        deadline = time.monotonic() + 300
        while "waiting for the first weight push" not in log_path.read_text(errors="replace"):
            assert generator.poll() is None and time.monotonic() < deadline, log_path.read_text()[-3000:]
            time.sleep(0.5)
        engine = descendants(generator.pid)
        assert {"VLLM::EngineCore", "VLLM::Worker"} <= names(engine), names(engine)
    finally:
        generator.kill()
        generator.wait()
    deadline = time.monotonic() + 30
    while alive(engine) and time.monotonic() < deadline:
        time.sleep(0.2)
    survivors = alive(engine)
    left = names(survivors)
    for pid, _ in survivors:
        os.kill(pid, signal.SIGKILL)
    assert survivors == [], f"outlived the generator: {left}"

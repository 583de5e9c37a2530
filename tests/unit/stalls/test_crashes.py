"""Why a service exited, read from its log (`asyncrlhf.stalls.crashes`), on the tails of real logs: a vLLM
generator whose engine could not allocate its KV cache, in its process and out of it; and how a stall names
a service that cannot start."""

import pytest

from asyncrlhf.stalls import Evidence, Flow, Hop, Replica, Wait, diagnose
from asyncrlhf.stalls.crashes import exit_note, last_run, reason
from asyncrlhf.stalls.diagnosis import Expected

pytestmark = pytest.mark.unit
KV = ("Available memory on node 0 (0.63/23.54 GiB) on kv cache allocation is less than requested memory "
      "for kv (1.0 GiB). Decrease --kv-cache-memory-bytes, VLLM_CPU_KVCACHE_SPACE, or reduce CPU memory used "
      "by other processes.")
DIED = "RuntimeError: Engine core initialization failed. See root cause above. Failed core proc(s): {}"
WORKER = "(Worker pid=13951) ERROR 12-05 20:50:20 [multiproc_executor.py:1063] "
# the engine in processes of its own: the worker's error first, then the engine core's, then the generator's
OUT_OF_PROCESS = "\n".join([
    "INFO 12-05 20:49:58 [cpu_worker.py:71] OMP threads binding of Process 13951",
    WORKER + "    raise ValueError(",
    WORKER + f"ValueError: {KV}",
    f"(EngineCore pid=13700) ERROR 12-05 20:50:20 [core.py:1510] RuntimeError: Worker failed with error "
    f"'{KV}', please check the stack trace above for the root cause",
    "Traceback (most recent call last):",
    '  File "/work/main/.venv/lib/python3.11/site-packages/vllm/v1/engine/utils.py", line 1431, in '
    "wait_for_engine_startup",
    "    raise RuntimeError(",
    DIED,
    "/root/.pyenv/versions/3.11.7/lib/python3.11/multiprocessing/resource_tracker.py:254: UserWarning: "
    "resource_tracker: There appear to be 1 leaked shared_memory objects to clean up at shutdown",
    ""])


def test_the_root_cause_and_what_the_process_died_of_are_named():
    assert reason(OUT_OF_PROCESS) == f"ValueError: {KV}; {DIED}"
    in_process = f'  File "cpu_worker.py", line 219\n[rank0]: ValueError: {KV}\n'
    assert reason(in_process) == f"ValueError: {KV}"


def test_a_log_that_names_no_exception_gives_its_last_line_and_an_empty_one_nothing():
    assert reason("starting\nKilled\n\n") == "Killed"
    assert reason("") == ""
    long = reason("ValueError: " + "x" * 400)
    assert long.endswith("x...") and len(long) == 300


def test_only_the_last_runs_output_is_read(tmp_path):
    log = tmp_path / "generator-0.log"
    log.write_text("RuntimeError: an earlier run's\n")
    offset = log.stat().st_size
    with log.open("a") as f:
        f.write(OUT_OF_PROCESS)
    assert reason(last_run(log, offset)).startswith("ValueError: Available memory")
    assert last_run(tmp_path / "never-started.log", 0) == ""


def test_a_stall_names_a_generator_that_cannot_start_and_why():
    note = exit_note(1, 52.4, 2, 600.0, reason(OUT_OF_PROCESS))
    e = Evidence(stepless_s=80.0, expected=Expected(1, 1, 6.0), wait_on=Wait.SCORED_GROUPS, waited_s=80.0,
                 flow=Flow(8, 0, 0, (), (Replica("reward-0", 0.3),)), not_starting=(f"generator-0 {note}",))
    stall = diagnose(e, 5.0)
    assert stall is not None and stall.hop is Hop.GENERATORS
    assert stall.message == (
        "no generator alive: waiting 80 s for scored groups: prompts queued 8, rollouts 0, scored 0; "
        "generators alive 0 of 1; cannot start: generator-0 exited with code 1 52 s after its start "
        f"(restarts in the last 600 s: 2): ValueError: {KV}; {DIED}")

"""The fork server `asyncrlhf up` starts services from on a CPU host (asyncrlhf/forkserver.py), with a real
server that imported torch, transformers and DeepSpeed: a forked child is the service it was asked to be
(environment, log, session, thread count, command line, exit code), computes in parallel, and its end is
learned whether it exits or is killed; a server that is gone is said so, and its children's ends still
seen."""

from __future__ import annotations

import json
import os
import signal
import sys
import time
from pathlib import Path

import pytest

from asyncrlhf.cores import ENV as CORES_ENV
from asyncrlhf.forkserver import ForkServer, ServerGone, serves

pytestmark = pytest.mark.integration
PROBE = "tests.integration.forkprobe"


def environment(**extra: str) -> dict[str, str]:
    return {**os.environ, "PYTHONUNBUFFERED": "1", "OMP_NUM_THREADS": "2", **extra}


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    logs = tmp_path_factory.mktemp("forkserver")
    forks = ForkServer(environment(), logs / "forkserver.log", "asyncrlhf fork server of the test")
    yield forks, logs
    forks.close()


def read(path: Path, timeout: float = 60) -> dict:
    deadline = time.monotonic() + timeout
    while not path.exists() or not path.read_text():
        assert time.monotonic() < deadline, f"{path} never written"
        time.sleep(0.1)
    time.sleep(0.1)  # written in one call; let it finish
    return json.loads(path.read_text())


def test_a_forked_child_is_the_service_asked_for_and_its_exit_code_arrives(server, tmp_path):
    forks, logs = server
    out, log = tmp_path / "probe.json", logs / "probe.log"
    title = f"{sys.executable} -m {PROBE} {out} 3"
    env = environment(PROBE_VAR="mine", OMP_NUM_THREADS="1")
    child = forks.spawn(PROBE, [str(out), "3"], env, log, title)
    assert child.wait(120) == 3 and child.poll() == 3
    seen = json.loads(out.read_text())
    assert seen["pid"] == child.pid == seen["sid"]  # a session of its own, as `start_new_session` gave
    assert seen["ppid"] == forks.proc.pid  # forked, not started afresh
    assert seen["probe_var"] == "mine" and seen["threads"] == 1
    assert seen["argv"][1:] == [str(out), "3"] and seen["main"] == "__main__"
    assert seen["cmdline"] == title  # what `ps` and `pgrep -f` read
    assert "probe: computed" in log.read_text()  # its output goes to its own log


def test_a_child_computes_on_two_threads_and_a_kill_is_reported_as_its_signal(server, tmp_path):
    forks, logs = server
    out = tmp_path / "probe.json"
    child = forks.spawn(PROBE, [str(out), "-1"], environment(), logs / "waiting.log", "waiting probe")
    seen = read(out)  # got past a parallel matmul on two threads, so libgomp survived the fork
    assert seen["threads"] == 2 and child.poll() is None
    os.kill(child.pid, signal.SIGKILL)
    assert child.wait(30) == -signal.SIGKILL


def test_a_server_serves_the_environments_that_differ_only_in_what_is_read_after_the_fork():
    base = {"PATH": "/usr/bin", "OMP_WAIT_POLICY": "PASSIVE", "OMP_NUM_THREADS": "2", CORES_ENV: "/a"}
    assert serves(base, {**base, "OMP_NUM_THREADS": "1", CORES_ENV: "/b"})  # applied after the fork
    assert serves(base, {k: v for k, v in base.items() if k != CORES_ENV})
    assert not serves(base, {"PATH": "/usr/bin", "OMP_NUM_THREADS": "2"})  # OpenMP's, read when torch loads
    assert not serves(base, {**base, "PYTHONPATH": "/elsewhere"})  # read when the libraries load


def test_a_server_that_dies_is_said_so_and_its_childrens_ends_are_still_seen(tmp_path):
    forks = ForkServer(environment(), tmp_path / "forkserver.log", "a fork server to kill")
    out = tmp_path / "probe.json"
    child = forks.spawn(PROBE, [str(out), "-1"], environment(), tmp_path / "orphan.log", "orphan probe")
    read(out)
    os.kill(forks.proc.pid, signal.SIGKILL)
    forks.proc.wait(10)
    assert child.poll() is None  # its child goes on, as a process started by `up` does when `up` dies
    with pytest.raises(ServerGone, match="forkserver.log"):
        forks.spawn(PROBE, [str(out), "0"], environment(), tmp_path / "next.log", "never")
    os.kill(child.pid, signal.SIGKILL)
    deadline = time.monotonic() + 30
    while child.poll() is None:
        assert time.monotonic() < deadline
        time.sleep(0.1)
    assert child.returncode == -signal.SIGKILL  # how it ended is lost with the server: counted as killed
    forks.close()

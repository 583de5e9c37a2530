"""The host's core share: a member computing alone takes every core, n busy members split them, a member that
died busy stops counting, and `up` gives it only to the services whose threads it may move."""

import os
import signal
import subprocess
import sys

import pytest
import torch

from asyncrlhf.config import load_config
from asyncrlhf.cores import ENV, OPENMP_WAIT_VARS, SHORT_SPIN, CoreShare, service_threads, shares_cores
from asyncrlhf.forkserver import loaded
from asyncrlhf.launcher import plan

pytestmark = pytest.mark.unit

HOLD_BUSY = """
import sys, time
from pathlib import Path
from asyncrlhf.cores import CoreShare
with CoreShare(Path(sys.argv[1]), sys.argv[2], 4).busy():
    print("busy", flush=True)
    time.sleep(600)
"""


@pytest.fixture
def threads_back():
    before = torch.get_num_threads()
    yield
    torch.set_num_threads(before)


def hold_busy(directory, member):
    proc = subprocess.Popen([sys.executable, "-c", HOLD_BUSY, str(directory), member], stdout=subprocess.PIPE,
                            text=True, env={**os.environ, "PYTHONPATH": os.getcwd()})
    assert proc.stdout.readline().strip() == "busy"
    return proc


def test_alone_a_member_takes_every_core_and_two_busy_members_split_them(tmp_path, threads_back):
    share = CoreShare(tmp_path, "learner-0", cores=4)
    with share.busy() as threads:
        assert threads == 4 and torch.get_num_threads() == 4  # the generator is idle: all four
        other = hold_busy(tmp_path, "generator-a")
        try:
            assert share.adjust() == 2 and torch.get_num_threads() == 2  # 4 cores // 2 busy
        finally:
            other.kill()
            other.wait()
    assert not (tmp_path / "learner-0").exists()  # not busy any more: it no longer counts for others


def test_a_member_killed_while_busy_stops_counting(tmp_path, threads_back):
    share = CoreShare(tmp_path, "learner-0", cores=4)
    other = hold_busy(tmp_path, "generator-a")
    assert share.busy_members() == 1 and share.threads() == 4 // 1
    with share.busy():
        assert share.busy_members() == 2
        other.send_signal(signal.SIGKILL)
        other.wait()
        assert (tmp_path / "generator-a").exists()  # SIGKILL left its file...
        assert share.busy_members() == 1 and share.adjust() == 4  # ...but its pid is gone


def test_a_half_written_or_foreign_file_is_not_a_member(tmp_path):
    (tmp_path / "generator-b.tmp").write_text(str(os.getpid()))  # a write in progress
    (tmp_path / "junk").write_text("not a pid")
    assert CoreShare(tmp_path, "learner-0", cores=2).busy_members() == 0


def test_no_directory_in_the_environment_means_fixed_threads(monkeypatch, tmp_path):
    monkeypatch.delenv(ENV, raising=False)
    assert CoreShare.from_env("learner-0") is None
    monkeypatch.setenv(ENV, str(tmp_path / "cores"))
    share = CoreShare.from_env("learner-0")
    assert share is not None and share.cores == (os.cpu_count() or 1) and (tmp_path / "cores").is_dir()


def test_up_shares_the_cores_of_the_hf_generator_and_the_learner_only(tmp_path):
    cfg = load_config(["configs/tiny.yaml"], [f"run.dir={tmp_path}"])
    cores = os.cpu_count() or 2
    assert shares_cores(cfg, "generator") and shares_cores(cfg, "learner")
    assert not shares_cores(cfg, "reward") and not shares_cores(cfg, "evaluator")
    assert service_threads(cfg, "learner") == cores and service_threads(cfg, "reward") == 1
    env_of = {s.name: s.env for s in plan(cfg, ["configs/tiny.yaml"], [], "redis://127.0.0.1:1")}
    assert env_of["learner"][ENV] == env_of["generator-0"][ENV] == str(cfg.run.path / "cores")
    assert ENV not in env_of["reward-0"]
    # members wait passively (a spinning OpenMP pool burns the core the other member needs)
    assert env_of["learner"]["OMP_WAIT_POLICY"] == env_of["generator-0"]["OMP_WAIT_POLICY"] == "PASSIVE"
    assert "GOMP_SPINCOUNT" not in env_of["learner"]
    fixed = load_config(["configs/tiny.yaml"], [f"run.dir={tmp_path}", "generator.threads=1"])
    assert not shares_cores(fixed, "generator") and service_threads(fixed, "generator") == 1  # the user's
    off = load_config(["configs/tiny.yaml"], [f"run.dir={tmp_path}", "launch.share_cores=false"])
    assert not shares_cores(off, "learner") and service_threads(off, "learner") == max(1, cores // 2)
    vllm = cfg.model_copy(update={"generator": cfg.generator.model_copy(update={"backend": "vllm"})})
    assert not shares_cores(vllm, "generator") and shares_cores(vllm, "learner")


def test_entering_and_leaving_leaves_nothing_behind(tmp_path, threads_back):
    share = CoreShare(tmp_path, "generator-a", cores=2)
    for _ in range(50):
        with share.busy():
            share.adjust()
    assert list(tmp_path.iterdir()) == []


def test_a_dead_predecessor_of_the_same_name_is_not_counted(tmp_path, threads_back):
    """A learner SIGKILLed while busy left `learner-0` behind; its restarted successor has the same name."""
    dead = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True,
                          text=True, check=True)
    (tmp_path / "learner-0").write_text(dead.stdout.strip())
    share = CoreShare(tmp_path, "learner-0", cores=4)
    assert share.busy_members() == 0
    with share.busy():
        assert share.busy_members() == 1 and share.threads() == 4


@pytest.mark.parametrize("chosen", [{"OMP_WAIT_POLICY": "ACTIVE"}, {"GOMP_SPINCOUNT": "100000"}])
def test_a_users_own_openmp_waiting_is_kept(tmp_path, monkeypatch, chosen):
    for var in OPENMP_WAIT_VARS:
        monkeypatch.delenv(var, raising=False)
    for var, value in chosen.items():
        monkeypatch.setenv(var, value)
    cfg = load_config(["configs/tiny.yaml"], [f"run.dir={tmp_path}"])
    env_of = {s.name: s.env for s in plan(cfg, ["configs/tiny.yaml"], [], "redis://127.0.0.1:1")}
    learner = env_of["learner"]
    assert {v: learner.get(v) for v in OPENMP_WAIT_VARS} == {v: chosen.get(v) for v in OPENMP_WAIT_VARS}


def test_members_that_never_compute_at_once_spin_briefly_instead(tmp_path, monkeypatch):
    """`max_staleness: 0`: generation and training alternate, so a pool spins a little between the small
    parallel regions of a decoding step (else a wake-up per region), never burning a busy member's core."""
    for var in OPENMP_WAIT_VARS:
        monkeypatch.delenv(var, raising=False)
    cfg = load_config(["configs/tiny.yaml"], [f"run.dir={tmp_path}", "learner.max_staleness=0"])
    env_of = {s.name: s.env for s in plan(cfg, ["configs/tiny.yaml"], [], "redis://127.0.0.1:1")}
    for member in ("learner", "generator-0"):
        assert env_of[member]["GOMP_SPINCOUNT"] == SHORT_SPIN and "OMP_WAIT_POLICY" not in env_of[member]


@pytest.mark.parametrize("staleness", [0, 1])
def test_one_thread_services_take_the_members_waiting_so_that_one_fork_server_serves_the_run(
        tmp_path, monkeypatch, staleness):
    """The wait settings change nothing in a process of one thread (no OpenMP workers to wait): the reward
    service and the evaluator take the members' and so load the libraries in the same environment. A service
    that may start an engine process (vLLM's, forked with its settings) keeps OpenMP's defaults."""
    for var in OPENMP_WAIT_VARS:
        monkeypatch.delenv(var, raising=False)
    cfg = load_config(["configs/tiny.yaml"], [f"run.dir={tmp_path}", f"learner.max_staleness={staleness}"])
    services = plan(cfg, ["configs/tiny.yaml"], [], "redis://127.0.0.1:1")
    waiting = {s.name: {v: s.env.get(v) for v in OPENMP_WAIT_VARS} for s in services}
    assert waiting["reward-0"] == waiting["evaluator"] == waiting["learner"] == waiting["generator-0"]
    assert any(waiting["learner"].values())
    assert len({loaded(s.env) for s in services}) == 1  # one fork server forks them all
    judged = load_config(["configs/tiny.yaml"], [
        f"run.dir={tmp_path}", "reward.scorers=[{kind: judge, model: {name_or_path: tiny}}]",
        "generator.backend=vllm", "model.tiny.heads=2"])
    env_of = {s.name: s.env for s in plan(judged, ["configs/tiny.yaml"], [], "redis://127.0.0.1:1")}
    for engine_starter in ("reward-0", "generator-0"):
        assert not any(v in env_of[engine_starter] for v in OPENMP_WAIT_VARS)
    assert env_of["evaluator"]["OMP_WAIT_POLICY"] == "PASSIVE"  # the learner still shares the cores


def test_a_gpu_recipe_on_a_cpu_host_forks_its_services_from_one_server_whatever_devices_they_name(tmp_path):
    """tldr names a GPU per service (`launch.gpus`); on a host without CUDA nothing reads them, so its
    services load the libraries alike and one fork server serves them all, each child given its own
    CUDA_VISIBLE_DEVICES (`_become`). Before, a config with `launch.gpus` got no fork server."""
    cfg = load_config(["configs/tldr.yaml"], [f"run.dir={tmp_path}", "launch.learner_procs=1"])
    services = plan(cfg, ["configs/tldr.yaml"], [], "redis://127.0.0.1:1")
    devices = {s.name: s.env["CUDA_VISIBLE_DEVICES"] for s in services}
    assert devices == {"reward-0": "0", "generator-0": "0", "learner": "1,2,3", "evaluator": "3"}
    assert len({loaded(s.env) for s in services}) == 1


PLAN_WITHOUT_TORCH = """
import sys
from asyncrlhf.config import load_config
from asyncrlhf.launcher import plan
from asyncrlhf.prestart import refusal
from asyncrlhf.training.checkpoint import latest_version
cfg = load_config(["configs/tiny.yaml"], [f"run.dir={sys.argv[1]}"])
plan(cfg, ["configs/tiny.yaml"], [], "redis://127.0.0.1:1")
print(refusal(cfg, ["configs/tiny.yaml"], [], print), latest_version(cfg), "torch" in sys.modules)
"""


@pytest.mark.skipif(not torch.__version__.endswith("+cpu"), reason="needs a CPU build of torch (`+cpu`)")
def test_the_launcher_checks_plans_and_reads_the_last_version_without_importing_a_cpu_torch(tmp_path):
    """`up` computes nothing with torch: with a `+cpu` build (no CUDA to ask about), its checks before the
    start, planning every service's threads, and reading the last version at the end leave torch unimported
    (1-2 CPU-seconds at every `up`)."""
    out = subprocess.run([sys.executable, "-c", PLAN_WITHOUT_TORCH, str(tmp_path)], capture_output=True,
                         text=True, env={**os.environ, "PYTHONPATH": os.getcwd()}, check=True).stdout
    assert out.splitlines()[-1] == "None None False"

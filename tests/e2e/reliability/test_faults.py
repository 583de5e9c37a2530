"""Fault injection on a live run (configs/tiny.yaml, every service its own process), each fault followed by
`asyncrlhf audit`: every group the learner enqueued is trained once, dropped or dead-lettered, or still in
flight within the credit bound; nothing is lost and nothing is trained twice.

CI runs `test_every_fault_in_one_run`: the five faults one after another on one run (a password-protected
Redis), a few steps each, then the bad entries of bad_input.py; the `slow` tests give each fault a
run of its own.
"""

from __future__ import annotations

import signal
import time

import pytest

from asyncrlhf import metrics as names
from asyncrlhf.consumed import Kind
from asyncrlhf.training.checkpoint import step_dir
from tests.e2e.reliability.bad_input import BAD_ENTRIES, inject_bad_entries
from tests.e2e.reliability.cluster import Cluster

pytestmark = pytest.mark.e2e


def assert_audit(cluster: Cluster) -> dict:
    report = cluster.audit()
    assert report["ok"] and not report["lost"] and not report["trained_twice"], report
    assert report["trained"] > 0, report
    return report


def kill_and_restart_reward(c: Cluster) -> None:
    """SIGKILL a reward replica mid-run: the other one (and re-claim of its pending groups) keeps training
    going; restarted, it scores again."""
    c.wait(
        lambda: c.procs["reward-0"].metrics().get(names.REWARD_GROUPS_SCORED_TOTAL, 0) > 0,
        "reward-0 to score something",
    )
    c.procs["reward-0"].kill()
    c.wait_steps(2, "with reward-0 dead", allow_dead=("reward-0",))
    c.start("reward-0")
    c.wait(
        lambda: c.procs["reward-0"].metrics().get(names.REWARD_GROUPS_SCORED_TOTAL, 0) > 0,
        "the restarted reward-0 to score",
    )
    assert_audit(c)


def kill_and_restart_generator(c: Cluster) -> None:
    """SIGKILL a generator: the others go on; restarted, it rejoins, gets the current weights, generates."""
    c.procs["generator-0"].kill()
    c.wait_steps(2, "with generator-0 dead", allow_dead=("generator-0",))
    c.start("generator-0")

    def rejoined() -> bool:
        m, learner = c.procs["generator-0"].metrics(), c.procs["learner"].metrics()
        version = next((v for k, v in m.items() if k.startswith(names.GENERATOR_POLICY_VERSION)), 0)
        # it serves the version the learner held when it joined (or a later one), and generates with it
        return (
            version >= 1
            and m.get(names.GENERATOR_GROUPS_TOTAL, 0) > 0
            and version >= learner.get(names.LEARNER_VERSION, 1e9) - 2
        )

    c.wait(rejoined, "the restarted generator-0 to receive the current weights and generate")
    assert_audit(c)


def kill_and_restart_learner(c: Cluster) -> None:
    """SIGKILL the learner right after a checkpoint; restarted, it resumes at that version."""
    before = c.latest_version()
    version = c.wait(
        lambda: (c.latest_version() or None) if c.latest_version() != before else None,
        "a new checkpoint",
    )
    c.procs["learner"].kill()
    c.start("learner")
    c.wait(
        lambda: (
            f"at version {version}" in c.procs["learner"].log_path.read_text()
            or "resumed from" in c.procs["learner"].log_path.read_text()
        ),
        "the learner to resume",
    )
    log = c.procs["learner"].log_path.read_text()
    resumed = [line for line in log.splitlines() if "resumed from" in line][-1]
    assert resumed.endswith(f"at version {version}") or step_dir(c.dir, version).name in resumed, resumed
    c.wait_steps(2, "after the learner restarted")
    assert_audit(c)


def restart_redis(c: Cluster) -> None:
    """Stop Redis (it flushes its append-only file) and start it again on the same port and files: every
    service reconnects with back-off and the run goes on with nothing lost."""
    c.wait_steps(1, "before the Redis restart")
    c.redis.stop()
    time.sleep(2)
    c.redis.start()
    c.wait_steps(3, "after the Redis restart")
    assert_audit(c)


def stall_generator(c: Cluster) -> None:
    """SIGSTOP a generator: its gRPC port accepts connections and never answers. The learner's push to it
    times out (learner.push_timeout_s), training continues on the other generator with staleness within
    the bound, and after SIGCONT it catches up."""
    gen = c.procs["generator-0"]
    gen.signal(signal.SIGSTOP)
    try:
        c.wait_steps(2, "with generator-0 stalled")
        failures = {
            k: v
            for k, v in c.procs["learner"].metrics().items()
            if k.startswith(names.LEARNER_PUSH_FAILURES_TOTAL) and "status=unreachable" in k
        }
        assert failures, "no push to the stalled generator timed out"
    finally:
        gen.signal(signal.SIGCONT)
    c.wait(
        lambda: gen.metrics().get(names.GENERATOR_GROUPS_TOTAL, 0) > 0, "generator-0 to answer again"
    )
    max_staleness = c.cfg.learner.max_staleness
    trained = [s for r in c.consumed() if r["kind"] == Kind.TRAINED for s in r["staleness"]]
    assert max(trained) <= max_staleness, f"trained a group {max(trained)} versions old"
    assert_audit(c)


FAULTS = [
    kill_and_restart_reward,
    kill_and_restart_generator,
    kill_and_restart_learner,
    restart_redis,
    stall_generator,
]


@pytest.fixture
def cluster(tmp_path):
    c = Cluster(tmp_path, redis_password="fault-pw")  # and every service authenticates to Redis
    yield c
    c.close()


def test_every_fault_in_one_run(cluster):
    cluster.start_all(generators=2, rewards=2)
    cluster.wait_steps(1, "to start", timeout_s=300)
    for fault in FAULTS:
        fault(cluster)
    inject_bad_entries(cluster)
    cluster.procs["learner"].stop()
    report = assert_audit(cluster)
    # no real group was dead-lettered: the faults lost nothing, and the bad entries are counted apart
    assert report["dead_lettered"] == 0 and report["foreign_dead_letters"] == BAD_ENTRIES, report


@pytest.mark.slow
@pytest.mark.parametrize("fault", FAULTS, ids=lambda f: f.__name__)
def test_fault_alone(cluster, fault):
    cluster.start_all(generators=2, rewards=2)
    cluster.wait_steps(3, "to start", timeout_s=300)
    fault(cluster)
    cluster.wait_steps(5, "after the fault")
    cluster.procs["learner"].stop()
    assert_audit(cluster)

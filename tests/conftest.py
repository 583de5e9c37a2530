"""Shared fixtures.

Redis: `redis_server` (session) is one embedded `redis-server` on a free loopback port; `redis_url` is its
URL; `redis_client` (function) is a bytes client to it, and `run_name` a fresh run name, so tests isolate
by key prefix (`asyncrlhf:<run_name>:...`) and never see each other's streams. Tests that restart or kill
Redis start their own `EmbeddedRedis` instead, or take `sentinel_cluster` (a primary, a replica and three
sentinels, for failovers).
"""

from __future__ import annotations

import importlib.util
import uuid
from collections.abc import Iterator

import pytest

from tests import cpu_time, schedule

VLLM_MISSING = ("vLLM is not installed: `make vllm` (Linux x86-64, vLLM's CPU build) or "
                "pip install 'asyncrlhf[vllm]' (CUDA)")


SLOW_UNSELECTED = "long run: select it with -m slow"


def pytest_collection_modifyitems(config, items):
    """Long runs carry the `slow` marker: they run only when selected (`pytest -m slow`, or
    `make test PYTEST_ARGS="-m slow"`); a plain `pytest` / `make test` reports them skipped, saying so.

    `vllm` tests skip only where vLLM is not installed; where it imports, none of them may skip, and those
    that put an engine in the test process (the CPU default, `generator.vllm.engine_in_process`) run last,
    under `make test` too (`rank`): such an engine takes the process over.
    vLLM's CPU worker replaces `torch.set_num_threads` with a no-op for good, and its shutdown destroys the
    default process group, which DeepSpeed's cached groups still point to, so a DeepSpeed or thread-count
    test after it would fail for a reason that is not its own."""
    if "slow" not in (config.getoption("markexpr") or ""):
        for item in items:
            if item.get_closest_marker("slow"):
                item.add_marker(pytest.mark.skip(reason=SLOW_UNSELECTED))
    if importlib.util.find_spec("vllm") is not None:
        items.sort(key=engine_in_this_process)  # stable: each part keeps its order
    else:
        for item in items:
            if "vllm" in item.keywords:
                item.add_marker(pytest.mark.skip(reason=VLLM_MISSING))


def pytest_configure(config):
    schedule.name_the_groups_file(config)


@pytest.hookimpl(tryfirst=True)  # before the worker tells the controller it has collected
def pytest_collection_finish(session):
    """`make test`'s workers (pytest-xdist, --dist loadgroup) take a group at a time: tests/schedule.py."""
    schedule.write_groups(session.items, worker_group, rank)


@pytest.hookimpl(tryfirst=True, optionalhook=True)
def pytest_xdist_make_scheduler(config, log):
    """Under `--dist loadgroup`: by `worker_group`, in the order of `rank`."""
    return schedule.ByGroup(config, log) if config.getoption("dist", default=None) == "loadgroup" else None


CPU_AT_SETUP = pytest.StashKey[float]()


@pytest.hookimpl(tryfirst=True)
def pytest_runtest_setup(item):
    item.stash[CPU_AT_SETUP] = cpu_time.spent()


@pytest.hookimpl(wrapper=True)
def pytest_runtest_teardown(item):
    """Each test's CPU, setup to teardown, as its `cpu_s` user property (tests/cpu_time.py)."""
    try:
        return (yield)
    finally:
        if CPU_AT_SETUP in item.stash:
            cpu = cpu_time.spent() - item.stash[CPU_AT_SETUP]
            item.user_properties.append((cpu_time.PROPERTY, round(cpu, 2)))


def pytest_terminal_summary(terminalreporter):
    """The costliest tests by CPU, before pytest's durations: on 2 busy cores what a test costs is its CPU."""
    lines = cpu_time.summary([r for reports in terminalreporter.stats.values() for r in reports
                              if hasattr(r, "user_properties")])
    if lines:
        terminalreporter.write_sep("=", "CPU per test")
        for line in lines:
            terminalreporter.write_line(line)


def engine_in_this_process(item) -> bool:
    """A vLLM test outside tests/e2e (whose runs start their engines in processes of their own)."""
    return "vllm" in item.keywords and not item.nodeid.startswith("tests/e2e/")


def worker_group(item) -> str:
    """What one worker runs from start to end: a test file (its module-scoped servers and engines are
    started once), its tests that put an engine in the test process apart."""
    file = item.nodeid.split("::")[0]
    return f"{file} (engine in the test process)" if engine_in_this_process(item) else file


def rank(item) -> int:
    """When a worker takes the test's group, the longest first: the whole runs (tests/e2e, the compose
    stack), then tests/integration, the rest, and last the tests that put an engine in the test process
    (after one, a worker takes no other test)."""
    if engine_in_this_process(item):
        return 3
    if item.nodeid.startswith("tests/e2e/") or item.get_closest_marker("compose"):
        return 0
    return 1 if item.nodeid.startswith("tests/integration/") else 2


@pytest.fixture(scope="session")
def redis_server() -> Iterator[EmbeddedRedis]:  # noqa: F821
    from asyncrlhf.redis_server import EmbeddedRedis

    with EmbeddedRedis() as server:
        yield server


@pytest.fixture(scope="session")
def redis_url(redis_server) -> str:
    return redis_server.url


@pytest.fixture
def run_name(request) -> str:
    """A run name unique to this test: keys `asyncrlhf:<run_name>:*` belong to it alone."""
    return f"test-{request.node.name[:40]}-{uuid.uuid4().hex[:8]}"


@pytest.fixture
def redis_client(redis_url, run_name):
    """A client to the session's embedded Redis; the test run's keys are deleted afterwards."""
    import redis

    from asyncrlhf.streams import run_key

    client = redis.Redis.from_url(redis_url)
    yield client
    keys = list(client.scan_iter(match=run_key(run_name, "*"), count=1000))
    if keys:
        client.delete(*keys)
    client.close()


@pytest.fixture
def sentinel_cluster(tmp_path_factory) -> Iterator[SentinelCluster]:  # noqa: F821
    """A primary, a replica and three sentinels (`tests.sentinels`), fresh for each test (tests kill the
    primary), stopped afterwards."""
    from tests.sentinels import SentinelCluster

    cluster = SentinelCluster(tmp_path_factory.mktemp("sentinels"))
    try:
        yield cluster.start()
    finally:
        cluster.stop()

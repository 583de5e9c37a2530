"""The CPU per test that every run prints (tests/cpu_time.py)."""

import subprocess
import sys
from types import SimpleNamespace

from tests.cpu_time import costliest, spent, summary


def report(nodeid: str, when: str, cpu: float | None) -> SimpleNamespace:
    return SimpleNamespace(nodeid=nodeid, when=when, user_properties=[] if cpu is None else [("cpu_s", cpu)])


def test_a_process_waited_for_is_counted_and_one_still_running_is_not():
    before = spent()
    subprocess.run([sys.executable, "-c", "sum(i * i for i in range(3_000_000))"], check=True)
    waited = spent() - before
    assert waited > 0.05  # the child's CPU, reaped by run()
    busy = subprocess.Popen([sys.executable, "-c", "sum(i * i for i in range(3_000_000))"])
    try:
        assert spent() - before - waited < 0.05  # not waited for yet: not counted
    finally:
        busy.wait()


def test_the_costliest_are_listed_from_the_teardown_reports_with_the_total():
    reports = [report("a", "setup", None), report("a", "call", None), report("a", "teardown", 1.5),
               report("b", "teardown", 7.25), report("c", "teardown", 0.0), report("d", "call", 99.0)]
    assert costliest(reports, n=2) == [(7.25, "b"), (1.5, "a")]
    lines = summary(reports)
    assert lines[0].startswith("9 CPU-s in 3 tests")
    assert [line.split()[-1] for line in lines[1:]] == ["b", "a", "c"]
    assert summary([report("a", "call", None)]) == []

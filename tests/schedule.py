"""How `make test`'s workers (pytest-xdist, `--dist loadgroup`) share the suite: a group at a time
(tests/conftest.py: `worker_group`, a test file, or a file's tests that put a vLLM engine in the test
process), the longest first (`rank`).

xdist learns a test's group from a suffix its worker appends to the test's id, which pytest 9.2 no longer
lets it change (pytest-dev/pytest-xdist#1386): every test went to whichever worker was free, so a file's
module-scoped servers started on both workers, and test_configs ran its configs twice. Here the workers
write each test's group and each group's rank to a file the controller names (`GROUPS_ENV`) once they
have collected, and the controller's scheduler (`ByGroup`) reads it.

xdist hands out the groups with the most tests first, which put the e2e files, few tests of minutes each,
at the end, where one of them could leave the other workers idle. Here the ranks order the queue (xdist's
order within a rank): the runs of minutes first, the groups that put an engine in the test process last.
Once a worker takes one of those, the queue holds nothing else, so no other test runs after an engine in
its process (the engine takes the process over; tests/conftest.py says how)."""

from __future__ import annotations

import json
import os
import shutil
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import Any

from xdist.scheduler import LoadGroupScheduling

GROUPS_ENV = "ASYNCRLHF_TEST_GROUPS"


def name_the_groups_file(config: Any) -> None:
    """On the controller of a `--dist loadgroup` run, before its workers start: where they write groups."""
    if hasattr(config, "workerinput") or config.getoption("dist", default=None) != "loadgroup":
        return
    folder = tempfile.mkdtemp(prefix="asyncrlhf-test-groups-")
    config.add_cleanup(lambda: shutil.rmtree(folder, ignore_errors=True))
    os.environ[GROUPS_ENV] = str(Path(folder) / "groups.json")  # the workers inherit it


def write_groups(items: list[Any], group_of: Callable[[Any], str], rank_of: Callable[[Any], int]) -> None:
    """On a worker, once collected (its tests' ids final): each test's group, and each group's rank (its
    tests' lowest), written whole or not at all."""
    path = os.environ.get(GROUPS_ENV)
    worker = os.environ.get("PYTEST_XDIST_WORKER")
    if not path or not worker:
        return
    groups = {item.nodeid: group_of(item) for item in items}
    ranks: dict[str, int] = {}
    for item in items:
        group, item_rank = groups[item.nodeid], rank_of(item)
        ranks[group] = min(item_rank, ranks.get(group, item_rank))
    tmp = Path(f"{path}.{worker}")
    tmp.write_text(json.dumps({"groups": groups, "ranks": ranks}))
    tmp.replace(path)  # every worker collects the same tests: whichever writes last, the map is the same


class ByGroup(LoadGroupScheduling):
    """Loadgroup scheduling by the groups and ranks the workers wrote."""

    def __init__(self, config: Any, log: Any = None) -> None:
        super().__init__(config, log)
        self.groups: dict[str, str] | None = None
        self.ranks: dict[str, int] = {}

    def _split_scope(self, nodeid: str) -> str:
        if self.groups is None:  # asked first once every worker has collected, so written by then
            path = os.environ.get(GROUPS_ENV)
            written = json.loads(Path(path).read_text()) if path and Path(path).exists() else {}
            self.groups, self.ranks = written.get("groups", {}), written.get("ranks", {})
        return self.groups.get(nodeid) or super()._split_scope(nodeid)

    def _assign_work_unit(self, node: Any) -> None:
        # every time: the units of a worker that crashed come back at the end of the queue
        for scope in sorted(self.workqueue, key=lambda s: self.ranks.get(s, 0)):  # stable sort
            self.workqueue.move_to_end(scope)
        super()._assign_work_unit(node)

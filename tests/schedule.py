"""How `make test`'s workers (pytest-xdist, `--dist loadgroup`) share the suite: by group (tests/conftest.py:
`worker_group`, a test file each, or every test that puts a vLLM engine in the test process).

xdist learns a test's group from a suffix its worker appends to the test's id, which pytest 9.2 no longer
lets it change (pytest-dev/pytest-xdist#1386): every test went to whichever worker was free, so a file's
module-scoped servers started on both workers, and test_configs ran its configs twice. Here the workers
write each test's group to a file the controller names (`GROUPS_ENV`) once they have collected, and the
controller's scheduler (`EngineApart`) reads it.

xdist hands out the largest groups first. The engine group goes first instead, to a worker of its own that
takes nothing after it (the engine takes its process over; tests/conftest.py says how), while the other
workers take the rest. With one worker it goes last, as in a run without workers."""

from __future__ import annotations

import json
import os
import shutil
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import Any

from xdist.scheduler import LoadGroupScheduling

ENGINE_GROUP = "engine-in-this-process"
GROUPS_ENV = "ASYNCRLHF_TEST_GROUPS"


def name_the_groups_file(config: Any) -> None:
    """On the controller of a `--dist loadgroup` run, before its workers start: where they write groups."""
    if hasattr(config, "workerinput") or config.getvalue("dist") != "loadgroup":
        return
    folder = tempfile.mkdtemp(prefix="asyncrlhf-test-groups-")
    config.add_cleanup(lambda: shutil.rmtree(folder, ignore_errors=True))
    os.environ[GROUPS_ENV] = str(Path(folder) / "groups.json")  # the workers inherit it


def write_groups(items: list[Any], group_of: Callable[[Any], str]) -> None:
    """On a worker, once collected (its tests' ids final): each test's group, written whole or not at all."""
    path = os.environ.get(GROUPS_ENV)
    worker = os.environ.get("PYTEST_XDIST_WORKER")
    if not path or not worker:
        return
    tmp = Path(f"{path}.{worker}")
    tmp.write_text(json.dumps({item.nodeid: group_of(item) for item in items}))
    tmp.replace(path)  # every worker collects the same tests: whichever writes last, the map is the same


class EngineApart(LoadGroupScheduling):
    """Loadgroup scheduling by the groups the workers wrote, with the engine group on a worker of its own
    (the first to ask, at the start)."""

    def __init__(self, config: Any, log: Any = None) -> None:
        super().__init__(config, log)
        self.engine_node: Any = None
        self.groups: dict[str, str] | None = None

    def _split_scope(self, nodeid: str) -> str:
        if self.groups is None:  # asked first once every worker has collected, so written by then
            path = os.environ.get(GROUPS_ENV)
            self.groups = json.loads(Path(path).read_text()) if path and Path(path).exists() else {}
        return self.groups.get(nodeid) or super()._split_scope(nodeid)

    def _assign_work_unit(self, node: Any) -> None:
        if ENGINE_GROUP in self.workqueue:
            if self.engine_node is None and len(self.nodes) > 1:
                self.engine_node = node
                self.workqueue.move_to_end(ENGINE_GROUP, last=False)
            elif len(self.workqueue) > 1:
                self.workqueue.move_to_end(ENGINE_GROUP)  # one worker: the engine's tests last
        super()._assign_work_unit(node)

    def _reschedule(self, node: Any) -> None:
        if node is self.engine_node:  # the engine group is all it runs: it stops once that is done
            if not node.shutting_down:
                node.shutdown()
            return
        super()._reschedule(node)

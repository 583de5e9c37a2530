"""DeepSpeed, imported without the mlflow import its autotuner makes.

`import deepspeed` imports `deepspeed.autotuning.autotuner` (through its runtime config), which imports mlflow
where it is installed (the `trackers` extra installs it) to log tuning results. Measured on a 2-core host,
mlflow takes 2.8 of the 3.4 s of CPU that importing DeepSpeed costs, in every learner rank, offline stage and
fork server. asyncrlhf never runs the autotuner. `import_deepspeed` refuses mlflow to that one module, as
DeepSpeed's own `try: import mlflow` expects where mlflow is missing, and to no other: a run that logs to
mlflow (`run.trackers`) imports it as before.
"""

from __future__ import annotations

import importlib.abc
import importlib.machinery
import inspect
import sys
from types import ModuleType

AUTOTUNER = "deepspeed.autotuning.autotuner"


class _NoMlflowForTheAutotuner(importlib.abc.MetaPathFinder):
    def find_spec(self, fullname: str, path: object = None,
                  target: ModuleType | None = None) -> importlib.machinery.ModuleSpec | None:
        if fullname.partition(".")[0] == "mlflow" and _imported_from(AUTOTUNER):
            raise ModuleNotFoundError(f"{fullname} is not imported for {AUTOTUNER} (asyncrlhf never runs it)",
                                      name=fullname)
        return None  # any other import: the next finder's


def _imported_from(module: str) -> bool:
    frame = inspect.currentframe()
    while frame is not None:
        if frame.f_globals.get("__name__") == module:
            return True
        frame = frame.f_back
    return False


def import_deepspeed() -> ModuleType:
    """`import deepspeed`, its autotuner without mlflow. Raises ImportError where DeepSpeed is missing."""
    if "deepspeed" in sys.modules:
        return sys.modules["deepspeed"]
    finder = _NoMlflowForTheAutotuner()
    sys.meta_path.insert(0, finder)
    try:
        return importlib.import_module("deepspeed")
    finally:
        sys.meta_path.remove(finder)

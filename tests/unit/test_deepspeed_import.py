"""`asyncrlhf.deepspeed_import`: DeepSpeed without the mlflow its autotuner imports, and mlflow still there
for everything else (the `run.trackers` mlflow tracker)."""

import subprocess
import sys

import pytest

from asyncrlhf.deepspeed_import import AUTOTUNER, _NoMlflowForTheAutotuner

pytest.importorskip("mlflow")  # a dev dependency: without it there is nothing to refuse


def test_deepspeed_imports_without_mlflow_and_mlflow_still_imports_afterwards():
    probe = ("import sys\n"
             "from asyncrlhf.deepspeed_import import import_deepspeed\n"
             "ds = import_deepspeed()\n"
             "import deepspeed.autotuning.autotuner as tuner\n"
             "print(ds.__name__, 'mlflow' in sys.modules, tuner.has_mlflow)\n"
             "import mlflow\n"
             "print(mlflow.__name__, import_deepspeed() is ds)\n")
    done = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    printed = done.stdout.splitlines()[-2:]  # after DeepSpeed's own log line
    assert printed == ["deepspeed False False", "mlflow True"], done.stdout


def test_only_the_autotuner_is_refused_mlflow():
    finder = _NoMlflowForTheAutotuner()
    assert finder.find_spec("mlflow") is None  # asked from here: the next finder's to find
    assert finder.find_spec("numpy") is None
    as_the_autotuner = {"__name__": AUTOTUNER, "finder": finder}
    for name in ("mlflow", "mlflow.tracking"):
        with pytest.raises(ModuleNotFoundError, match=AUTOTUNER):
            exec(f"finder.find_spec({name!r})", as_the_autotuner)
    exec("assert finder.find_spec('yaml') is None", as_the_autotuner)

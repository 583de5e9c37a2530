"""The offline stages on the tiny model: each command through `asyncrlhf.cli.main`, in a fresh run dir."""

import pytest

from asyncrlhf.cli import main


@pytest.fixture
def stage(tmp_path):
    """`stage("sft", "sft.epochs=2")` runs
    `asyncrlhf sft --config configs/tiny.yaml run.dir=<tmp> sft.epochs=2`."""

    def run(command: str, *args: str) -> int:
        return main([command, "--config", "configs/tiny.yaml", f"run.dir={tmp_path}", *args])

    return run

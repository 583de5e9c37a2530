"""deploy/Dockerfile, read as text (no Docker engine here): both targets exist, run as a non-root user,
check /healthz, bake no config and no token in."""

from __future__ import annotations

import re

import pytest

from tests.unit.deploy.helpers import DEPLOY

pytestmark = pytest.mark.unit


def stages() -> dict[str, str]:
    text = (DEPLOY / "Dockerfile").read_text()
    parts = re.split(r"^FROM\s+\S+\s+AS\s+(\S+)\s*$", text, flags=re.MULTILINE)
    return dict(zip(parts[1::2], parts[2::2], strict=True))


def test_gpu_and_cpu_targets():
    assert set(stages()) == {"gpu", "cpu"}
    text = (DEPLOY / "Dockerfile").read_text()
    assert re.search(r"^ARG CUDA_IMAGE=nvidia/cuda:\S+devel", text, flags=re.MULTILINE)
    assert "vllm" in stages()["gpu"] and "deepspeed" in stages()["gpu"]
    assert "download.pytorch.org/whl/cpu" in stages()["cpu"]


@pytest.mark.parametrize("target", ["gpu", "cpu"])
def test_each_target_runs_as_non_root_checks_health_and_bakes_in_no_config(target):
    body = stages()[target]
    assert re.search(r"^USER asyncrlhf$", body, flags=re.MULTILINE)
    assert re.search(r"^HEALTHCHECK .*\n?.*/healthz", body, flags=re.MULTILINE)
    assert 'ENTRYPOINT ["asyncrlhf"]' in body
    copied = re.findall(r"^COPY\s+(.+)$", body, flags=re.MULTILINE)
    assert not any("configs" in c or ".env" in c for c in copied), copied
    assert "ASYNCRLHF_TOKEN" not in body

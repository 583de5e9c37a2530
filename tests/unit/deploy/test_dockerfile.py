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
    assert set(stages()) == {"gpu", "requirements", "cpu"}
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


def test_no_docker_hub_only_syntax_and_base_images_and_torch_index_are_build_args():
    text = (DEPLOY / "Dockerfile").read_text()
    syntax = re.search(r"^#\s*syntax\s*=", text, flags=re.MULTILINE | re.IGNORECASE)
    assert not syntax, "a `# syntax=` line pulls a frontend image from Docker Hub"
    froms = re.findall(r"^FROM\s+(\S+)", text, flags=re.MULTILINE)
    assert froms == ["${CUDA_IMAGE}", "${PYTHON_IMAGE}", "${PYTHON_IMAGE}"]
    cpu = stages()["cpu"]
    assert re.search(r"^ARG TORCH_INDEX_URL=https://download\.pytorch\.org/whl/cpu$", cpu, flags=re.MULTILINE)
    assert '--index-url "${TORCH_INDEX_URL}"' in cpu
    assert "https://" not in cpu.replace("ARG TORCH_INDEX_URL=https://", ""), "an index URL outside the args"


@pytest.mark.parametrize("target", ["gpu", "cpu"])
def test_pip_settings_and_the_ca_bundle_can_be_handed_to_every_pip_install(target):
    body = stages()[target]
    for arg in ("PIP_INDEX_URL", "PIP_EXTRA_INDEX_URL", "PIP_TRUSTED_HOST", "PIP_NO_INDEX"):
        assert re.search(rf"^ARG {arg}$", body, flags=re.MULTILINE), arg
    runs = re.findall(r"^RUN (.*?)(?<!\\)$", body, flags=re.MULTILINE | re.DOTALL)
    # every install that can reach an index (the project's own, --no-deps without build isolation, cannot)
    own = "pip install --no-deps --no-build-isolation ."
    installs = [r for r in runs if "pip install" in r and own not in r]
    assert installs
    for run in installs:
        assert "--mount=type=secret,id=pip_cert" in run and "PIP_CERT=/run/secrets/pip_cert" in run, run


def test_cpu_layers_keep_torch_deepspeed_and_dependencies_below_the_code_and_prebuild_deepspeeds_op():
    cpu = stages()["cpu"]
    torch = cpu.index('"torch==${TORCH_VERSION}"')
    deps = cpu.index("-r /tmp/asyncrlhf/requirements.txt")
    op = cpu.index("build_shm_op()")
    code = cpu.index("COPY asyncrlhf ")
    assert torch < op < deps < code < cpu.index("USER asyncrlhf")
    # the dependency list alone (not the rest of pyproject.toml) keys the dependency layers
    assert "COPY --from=requirements /requirements.txt" in cpu[:deps]
    assert "COPY pyproject.toml" not in cpu[:deps]
    assert "source=deploy/wheelhouse/deepspeed," in cpu[torch:op], "DeepSpeed's layer mounts only its wheels"
    assert "source=deploy/wheelhouse/torch," in cpu[:torch + 200], "torch's layer mounts only torch's wheel"
    owned = re.search(r'chown -R asyncrlhf:asyncrlhf "\$\{TORCH_EXTENSIONS_DIR\}"', cpu)
    assert owned, "the learner (uid 1000) takes a lock file there when it loads the op"
    assert "TORCH_EXTENSIONS_DIR=/opt/venv/torch_extensions" in cpu
    assert "-c /opt/venv/torch-constraint.txt" in cpu, "a later install could replace the CPU torch"

"""The vLLM the GPU image installs, and the one pyproject's `vllm` extra allows, are ones the backend
accepts."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
import tomllib

from asyncrlhf.sampling.vllm import MIN_VLLM, version_tuple
from tests.unit.deploy.helpers import DEPLOY

pytestmark = pytest.mark.unit


def test_the_dockerfile_pins_a_vllm_the_backend_accepts():
    (pin,) = re.findall(r"^ARG VLLM_VERSION=(\S+)$", (DEPLOY / "Dockerfile").read_text(), flags=re.MULTILINE)
    assert version_tuple(pin) >= MIN_VLLM, f"deploy/Dockerfile pins vLLM {pin}; the backend needs {MIN_VLLM}"


def test_the_vllm_extra_allows_no_older_vllm():
    project = tomllib.loads((Path(__file__).resolve().parents[3] / "pyproject.toml").read_text())
    (spec,) = project["project"]["optional-dependencies"]["vllm"]
    floor = re.fullmatch(r"vllm>=(\S+)", spec)
    assert floor and version_tuple(floor.group(1)) >= MIN_VLLM, spec

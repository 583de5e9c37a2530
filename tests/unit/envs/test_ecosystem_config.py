"""`task.env` kinds `verifiers` and `openenv` where their packages (the `envs` extra) are missing, and their
config checks: clear errors saying what to do."""

from __future__ import annotations

import sys

import pytest

from asyncrlhf.config import EnvConfig
from asyncrlhf.envs.loading import EnvConfigError, EnvFactory

pytestmark = pytest.mark.unit
INSTALL = r"pip install 'asyncrlhf\[envs\]'"


def test_a_missing_verifiers_package_says_how_to_install_it(monkeypatch):
    monkeypatch.setitem(sys.modules, "verifiers", None)  # `import verifiers` raises ImportError
    with pytest.raises(EnvConfigError, match=f"needs the verifiers package: {INSTALL}"):
        EnvFactory(EnvConfig(kind="verifiers", name="asyncrlhf.envs.vf_arithmetic"))


def test_a_missing_websockets_package_says_how_to_install_it(monkeypatch):
    monkeypatch.setitem(sys.modules, "websockets.sync.client", None)
    with pytest.raises(EnvConfigError, match=f"needs the websockets package: {INSTALL}"):
        EnvFactory(EnvConfig(kind="openenv", url="http://127.0.0.1:9"))


@pytest.mark.parametrize("fields, message", [
    ({"kind": "verifiers"}, "needs task.env.name"),
    ({"kind": "openenv"}, "needs task.env.url"),
    ({"kind": "openenv", "url": "localhost:8000"}, "http\\(s\\):// or ws\\(s\\):// base URL"),
])
def test_each_kind_says_what_it_needs(fields, message):
    with pytest.raises(ValueError, match=message):
        EnvConfig(**fields)

"""The engine hops' parts that run without an engine: the config's vocabulary for them, and the package's map
(the engine itself: tests/integration/vllm/test_hop_contract.py)."""

import re
from pathlib import Path

import pytest

import asyncrlhf.sampling.hops as hops
from asyncrlhf.config import ConfigError, EngineHandoff, load_config
from asyncrlhf.sampling.hops.hop import HopKind

pytestmark = pytest.mark.unit


def test_the_handoff_keeps_the_values_configs_have_and_refuses_others_naming_them():
    for value in ("auto", "shm", "file"):
        cfg = load_config(["configs/tiny.yaml"], [f"generator.vllm.handoff={value}"])
        assert cfg.generator.vllm.handoff is EngineHandoff(value)
        assert f"handoff: {value}" in cfg.to_yaml()  # saved as the value a config is written with
    with pytest.raises(ConfigError, match=r"generator.vllm.handoff.*'auto', 'shm' or 'file'.*got 'nfs'"):
        load_config(["configs/tiny.yaml"], ["generator.vllm.handoff=nfs"])


def test_the_package_map_names_every_module_of_the_package_and_no_other():
    directory = Path(hops.__file__).parent
    named = set(re.findall(r"^    (\w+\.py) ", hops.__doc__ or "", re.MULTILINE))
    assert named == {p.name for p in directory.glob("*.py") if p.name != "__init__.py"}


def test_every_hop_kind_has_a_worker_half():
    from asyncrlhf.sampling.hops.worker import _HALVES

    assert set(_HALVES) == set(HopKind)

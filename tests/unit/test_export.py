"""The base an exported LoRA adapter names (`asyncrlhf.export.base_reference`): a hub id with the commit the
run resolved it to, or a local directory's absolute path; a base that exists only on this machine is
refused, saying to merge. The exports themselves, loaded by transformers, PEFT and vLLM:
tests/integration/test_export.py."""

from __future__ import annotations

import pytest

from asyncrlhf.config import ModelConfig
from asyncrlhf.export import ExportError, base_reference

pytestmark = pytest.mark.unit
COMMIT = "0123456789abcdef0123456789abcdef01234567"


def test_a_hub_base_is_named_by_id_and_commit():
    model = ModelConfig(name_or_path="HuggingFaceTB/SmolLM2-135M-Instruct", allow_hub=True, revision=COMMIT)
    assert base_reference(model) == ("HuggingFaceTB/SmolLM2-135M-Instruct", COMMIT)


def test_a_local_base_is_named_by_its_absolute_path(tmp_path, monkeypatch):
    (tmp_path / "base").mkdir()
    monkeypatch.chdir(tmp_path)
    assert base_reference(ModelConfig(name_or_path="base")) == (str(tmp_path / "base"), None)


@pytest.mark.parametrize("name, gguf", [("tiny", None), ("smollm2-135m-instruct", None),
                                        ("/models/m.Q8_0.gguf", None), ("/models", "m.gguf")])
def test_a_base_that_exists_only_here_needs_a_merge(name, gguf):
    with pytest.raises(ExportError, match="--merge-lora"):
        base_reference(ModelConfig(name_or_path=name, gguf_file=gguf))

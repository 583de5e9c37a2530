"""The reward model's digest: the same model written by other library versions keeps it, another model does
not, and a file that is not what its name says is refused with what to do."""

import json

import pytest
import torch
from safetensors.torch import save_file

from asyncrlhf.bench.digest import model_digest

pytestmark = pytest.mark.unit

WEIGHTS = {"score.weight": torch.arange(6, dtype=torch.float32).reshape(2, 3),
           "model.norm.weight": torch.ones(4)}


def write_model(path, tensors=WEIGHTS, config=None, metadata=None, indent=2):
    path.mkdir(parents=True, exist_ok=True)
    save_file(tensors, path / "model.safetensors", metadata=metadata)
    config = config or {"model_type": "llama", "hidden_size": 4, "transformers_version": "5.23.0"}
    (path / "config.json").write_text(json.dumps(config, indent=indent))
    (path / "chat_template.jinja").write_text("{{ messages }}")
    return path


def test_the_same_model_serialised_by_other_library_versions_has_the_same_digest(tmp_path):
    first = model_digest(write_model(tmp_path / "a"))
    # another transformers stamps config.json, lays it out otherwise; safetensors writes other metadata and
    # orders the tensors otherwise; a training summary is added
    other = write_model(tmp_path / "b", tensors=dict(reversed(list(WEIGHTS.items()))),
                        config={"hidden_size": 4, "model_type": "llama", "transformers_version": "5.24.0"},
                        metadata={"format": "pt"}, indent=None)
    (other / "training.json").write_text('{"seconds": 402.0}')
    assert model_digest(other) == first


@pytest.mark.parametrize("change", ["one_weight", "shape", "dtype", "config", "template"])
def test_a_different_model_has_a_different_digest(tmp_path, change):
    base = model_digest(write_model(tmp_path / "base"))
    tensors = dict(WEIGHTS)
    config = {"model_type": "llama", "hidden_size": 4, "transformers_version": "5.23.0"}
    if change == "one_weight":
        w = tensors["score.weight"].clone()
        w[1, 2] = torch.nextafter(w[1, 2], torch.tensor(100.0))  # one ulp
        tensors["score.weight"] = w
    elif change == "shape":
        tensors["score.weight"] = tensors["score.weight"].reshape(3, 2)
    elif change == "dtype":
        tensors["model.norm.weight"] = tensors["model.norm.weight"].to(torch.bfloat16)
    elif change == "config":
        config["hidden_size"] = 8
    path = write_model(tmp_path / "other", tensors=tensors, config=config)
    if change == "template":
        (path / "chat_template.jinja").write_text("{{ messages | reverse }}")
    assert model_digest(path) != base


def test_files_that_are_not_what_their_names_say_are_refused_with_what_to_do(tmp_path):
    path = write_model(tmp_path / "rm")
    (path / "model.safetensors").write_bytes(b"weights")
    with pytest.raises(SystemExit, match="not a safetensors file: it has no header"):
        model_digest(path)
    (path / "model.safetensors").write_bytes(b"\x10\x00\x00\x00\x00\x00\x00\x00not json at all!")
    with pytest.raises(SystemExit, match="its header is not JSON"):
        model_digest(path)
    save_file(WEIGHTS, path / "model.safetensors")
    data = (path / "model.safetensors").read_bytes()
    (path / "model.safetensors").write_bytes(data[:-8])
    with pytest.raises(SystemExit, match="truncated: `.*` ends past the end of the file"):
        model_digest(path)
    save_file(WEIGHTS, path / "model.safetensors")
    (path / "config.json").write_text("{not json")
    with pytest.raises(SystemExit, match=r"config.json is not valid JSON .*is this directory a model"):
        model_digest(path)

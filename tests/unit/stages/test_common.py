import json

import pytest

from asyncrlhf.stages.common import StageError, read_records, split_flags

pytestmark = pytest.mark.unit


def test_split_flags_multi_and_single_values():
    found, rest = split_flags(
        ["--config", "c.yaml", "--checkpoint", "a", "b", "x.y=1", "--output=o.jsonl", "--learner.lr", "2"],
        {"--checkpoint": True, "--output": False},
    )
    assert found == {"--checkpoint": ["a", "b"], "--output": ["o.jsonl"]}
    assert rest == ["--config", "c.yaml", "x.y=1", "--learner.lr", "2"]


def test_split_flags_single_value_takes_one():
    found, rest = split_flags(["--output", "o", "run.name=x"], {"--output": False})
    assert found == {"--output": ["o"]} and rest == ["run.name=x"]
    with pytest.raises(StageError, match="needs a value"):
        split_flags(["--output"], {"--output": False})


def test_read_records_checks_fields(tmp_path):
    path = tmp_path / "d.jsonl"
    path.write_text(
        json.dumps({"prompt": "p", "completion": "c"}) + "\n\n" + json.dumps({"prompt": "q"}) + "\n"
    )
    with pytest.raises(StageError, match="row 2 needs string field"):
        read_records(path, ["prompt", "completion"])
    assert len(read_records(path, ["prompt"])) == 2
    with pytest.raises(StageError, match="does not exist"):
        read_records(tmp_path / "missing.jsonl", ["prompt"])

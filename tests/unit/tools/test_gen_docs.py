"""The generated reference pages (tools/gen_docs.py) match the code, and the configuration reference names
every key of the config tree, each with a description."""

import re
from pathlib import Path

import pytest

from tools.gen_docs import PAGES, REFERENCE, config_page

pytestmark = pytest.mark.unit


@pytest.mark.parametrize("name", list(PAGES))
def test_the_committed_page_is_what_the_code_generates(name):
    assert (REFERENCE / name).read_text() == PAGES[name](), (
        f"docs/reference/{name} is stale: run `make docs-gen`"
    )


def tree_keys() -> dict[str, object]:
    """Every leaf key of the config tree (`reward.scorers[].name`, `learner.ppo.clip_eps`), walked from the
    pydantic models themselves, not from the generator -> its FieldInfo."""
    from types import UnionType
    from typing import Annotated, Union, get_args, get_origin

    from asyncrlhf.config import Config, Section

    keys: dict[str, object] = {}

    def sections(annotation) -> list[type]:
        """The sections a field holds: one, the members of a (tagged) union, or none for a plain value."""
        if get_origin(annotation) is Annotated:
            annotation = get_args(annotation)[0]
        union = get_origin(annotation) in (Union, UnionType)
        return [a for a in (get_args(annotation) if union else (annotation,))
                if isinstance(a, type) and issubclass(a, Section)]

    def walk(cls, prefix):
        for name, field in cls.model_fields.items():
            many = get_origin(field.annotation) is list
            members = sections(get_args(field.annotation)[0] if many else field.annotation)
            if not members:
                keys[f"{prefix}{name}"] = field
            for member in members:
                walk(member, f"{prefix}{name}{'[]' if many else ''}.")

    walk(Config, "")
    return keys


def test_every_key_of_the_config_tree_is_in_the_reference():
    page = config_page()
    documented = set(re.findall(r"^\| `([^`]+)` \|", page, re.M))
    keys = tree_keys()
    assert len(keys) > 150
    assert sorted(set(keys) - documented) == []
    assert sorted(documented - set(keys)) == []


def test_every_default_is_visible_scorers_by_name_and_the_learners_algorithm():
    """A section's default that a table cannot show (a list of scorers, which member of a union) is written
    under its heading; a union's tag shows the member it takes when left out."""
    page = config_page()
    def under(heading: str) -> str:
        return page.split(heading, 1)[1].lstrip().split("\n", 1)[0]

    sentiment = '{"kind": "rule", "name": "sentiment"}'
    assert under("### `reward.scorers[]` (every `kind`)") == f"Default: `[{sentiment}]`."
    assert under("### `evaluator.gold` (every `kind`)") == f"Default: `{sentiment}`."
    assert '| `learner.algorithm` | str | `"online_dpo"` |' in page
    assert "| required |" not in page.split("## `learner` (every `algorithm`)")[1].split("###")[0]


def test_every_key_has_a_description():
    page = config_page()
    undescribed = [
        row.split("|")[1].strip()
        for row in page.splitlines()
        if row.startswith("| `") and row.rstrip().endswith("|  |")
    ]
    assert undescribed == [], "give these fields a `description=` in asyncrlhf/config/"


def test_every_metric_name_is_in_the_metrics_reference():
    from asyncrlhf.metrics import NAMES

    page = (REFERENCE / "metrics.md").read_text()
    assert sorted(n for n in NAMES if f"`{n}`" not in page) == []


def test_every_command_is_in_the_cli_reference():
    from asyncrlhf.cli import COMMANDS

    page = Path(REFERENCE / "cli.md").read_text()
    assert sorted(c for c in COMMANDS if f"## `asyncrlhf {c}`" not in page) == []

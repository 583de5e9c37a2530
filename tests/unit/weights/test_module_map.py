"""The module map in `asyncrlhf/weights/__init__.py` is the package's table of contents: it names every module
there is, and no module that is not there."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

import asyncrlhf.weights

pytestmark = pytest.mark.unit

PACKAGE = Path(asyncrlhf.weights.__file__).parent


def named_modules(doc: str) -> set[str]:
    """The `name.py` files a docstring names, leaving out paths into other packages (`services/.../x.py`)."""
    return set(re.findall(r"(?<![/\w])(\w+\.py)\b", doc))


def test_named_modules_leaves_out_paths_elsewhere():
    assert named_modules("a.py, b.py: x; services/learner/sync.py -> c.py") == {"a.py", "b.py", "c.py"}


def test_the_weights_module_map_names_every_module_and_only_those():
    present = {p.name for p in PACKAGE.glob("*.py") if p.name != "__init__.py"}
    named = named_modules(asyncrlhf.weights.__doc__ or "")
    assert (sorted(present - named), sorted(named - present)) == ([], []), \
        "asyncrlhf/weights/__init__.py's map: (add, drop)"

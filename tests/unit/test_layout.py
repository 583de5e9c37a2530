"""The layout of docs/design.md, checked from the code's own definitions: files and classes stay short enough
to read. What may import what is `make lint`'s (import-linter's contracts in pyproject.toml)."""

import ast
from pathlib import Path

import pytest

pytestmark = pytest.mark.unit

REPO = Path(__file__).resolve().parents[2]
MAX_FILE_LINES = 400
MAX_CLASS_LINES = 200


def sources(package: str) -> list[Path]:
    return [p for p in sorted((REPO / package).rglob("*.py")) if "_proto" not in p.parts]


def test_files_and_classes_stay_short():
    too_long = []
    for path in sources("asyncrlhf") + sources("services"):
        text = path.read_text()
        lines = len(text.splitlines())
        if lines > MAX_FILE_LINES:
            too_long.append(f"{path.relative_to(REPO)}: {lines} lines")
        for node in ast.walk(ast.parse(text)):
            if isinstance(node, ast.ClassDef) and node.end_lineno - node.lineno + 1 > MAX_CLASS_LINES:
                too_long.append(f"{path.relative_to(REPO)}: class {node.name} "
                                f"{node.end_lineno - node.lineno + 1} lines")
    assert too_long == []

"""The layout of docs/design.md, checked from the code's own imports and definitions: the library never
imports a service, no service imports another, and files and classes stay short enough to read."""

import ast
from pathlib import Path

import pytest

pytestmark = pytest.mark.unit

REPO = Path(__file__).resolve().parents[2]
MAX_FILE_LINES = 400
MAX_CLASS_LINES = 200


def sources(package: str) -> list[Path]:
    return [p for p in sorted((REPO / package).rglob("*.py")) if "_proto" not in p.parts]


def imported_modules(path: Path) -> set[str]:
    """Every module an import statement names, at any depth (lazy imports inside functions included)."""
    names: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            names.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            names.add(node.module)
            names.update(f"{node.module}.{alias.name}" for alias in node.names)
    return names


def test_the_library_never_imports_services():
    offenders = {str(p.relative_to(REPO)): sorted(m for m in imported_modules(p)
                                                  if m.split(".")[0] == "services")
                 for p in sources("asyncrlhf")}
    assert {p: m for p, m in offenders.items() if m} == {}


def test_no_service_imports_another_service():
    offenders = {}
    for path in sources("services"):
        own = path.relative_to(REPO / "services").parts[0]
        others = sorted(m for m in imported_modules(path)
                        if m.startswith("services.") and m.split(".")[1] not in (own,))
        if others:
            offenders[str(path.relative_to(REPO))] = others
    assert offenders == {}


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

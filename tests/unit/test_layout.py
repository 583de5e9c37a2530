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


def layout_entries(block: str) -> set[str]:
    """The paths a layout block names, relative to the repository: each unindented `path/` is a root, and
    each entry indented by two spaces under it (`config/`, `version.py`) a child of that root; deeper
    indentation continues an entry's description."""
    entries: set[str] = set()
    root = ""
    for line in block.splitlines():
        name = line.split(maxsplit=1)[0] if line.strip() else ""
        if line[:1].strip():
            root = name.rstrip("/")
            entries.add(root)
        elif line.startswith("  ") and line[2:3].strip() and root:
            entries.add(f"{root}/{name.rstrip('/')}")
    return entries


def layout_drift(block: str, roots: list[str]) -> tuple[list[str], list[str]]:
    """What the layout `block` leaves out of `roots` (each package and module directly under them) and what it
    names that is not in the repository."""
    entries = layout_entries(block)
    present = {str(p.relative_to(REPO)) for root in roots for p in (REPO / root).iterdir()
               if (p / "__init__.py").exists() or (p.suffix == ".py" and p.stem != "__init__")}
    return sorted(present - entries), sorted(e for e in entries if not (REPO / e).exists())


def design_layout() -> str:
    """The code block of docs/design.md's "Layout" section."""
    section = (REPO / "docs" / "design.md").read_text().split("\n## Layout", 1)[1].split("\n## ", 1)[0]
    return section.split("```\n", 2)[1]


def test_layout_entries_reads_roots_children_and_continuations():
    block = ("pkg/\n"
             "  a/        the a package,\n"
             "            described over two lines\n"
             "  b.py      one module\n"
             "tools/    what tools do\n")
    assert layout_entries(block) == {"pkg", "pkg/a", "pkg/b.py", "tools"}


def test_the_design_layout_names_every_package_and_module_there_is():
    missing, stale = layout_drift(design_layout(), ["asyncrlhf", "services"])
    assert (missing, stale) == ([], []), f"docs/design.md's layout: add {missing}, drop {stale}"

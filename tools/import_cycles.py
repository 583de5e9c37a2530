"""Import cycles between the files of a package, for `make lint`.

Every import statement is an edge, wherever it stands: under `if TYPE_CHECKING:` and inside a function too.
A cycle hidden from the interpreter that way is still two files that cannot be read, tested or moved one
without the other (docs/contributing.md, "How the code reads", principle 11: a split that needs an import
back is one module cut in two).

An edge goes to the module an import names and to nothing above it: `import a.b.c` and `from a.b import c`
(where `c` is a submodule) point at `a/b/c.py`, `from a.b import name` at `a/b/__init__.py`. So a package's
`__init__` that re-exports its children is not a cycle; a child that imports from its own package's
`__init__` while that `__init__` imports the child is one.

    python tools/import_cycles.py asyncrlhf services --exclude asyncrlhf/_proto

prints each cycle (its files, then each import inside it, with its line) and exits 1; 0 when there is none.
"""

from __future__ import annotations

import argparse
import ast
import sys
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path


@dataclass(frozen=True)
class Edge:
    """One import statement that names another scanned module."""

    source: str  # the importing module
    target: str  # the module imported
    line: int
    where: str  # "" at module level, else "TYPE_CHECKING" or "in a function"


def module_name(path: Path, root: Path) -> str:
    """`a/b/c.py` -> `a.b.c`; `a/b/__init__.py` -> `a.b`."""
    parts = list(path.relative_to(root).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def collect_modules(packages: Iterable[Path], root: Path, excluded: Sequence[Path] = ()) -> dict[str, Path]:
    """Every `.py` file under `packages`, by dotted module name, less those under an `excluded` folder."""
    modules: dict[str, Path] = {}
    for package in packages:
        for path in sorted(package.rglob("*.py")):
            if not any(path.is_relative_to(folder) for folder in excluded):
                modules[module_name(path, root)] = path
    return modules


def _is_type_checking(test: ast.expr) -> bool:
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or (
        isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING")


def _imports(node: ast.AST, where: str = "") -> Iterator[tuple[ast.Import | ast.ImportFrom, str]]:
    """Every import statement under `node`, with where it stands (the outermost reason wins)."""
    for child in ast.iter_child_nodes(node):
        if isinstance(child, ast.Import | ast.ImportFrom):
            yield child, where
        elif isinstance(child, ast.If) and _is_type_checking(child.test):
            for branch in child.body:
                yield from _imports_in(branch, where or "TYPE_CHECKING")
            for branch in child.orelse:
                yield from _imports_in(branch, where)
        elif isinstance(child, ast.FunctionDef | ast.AsyncFunctionDef | ast.Lambda):
            yield from _imports(child, where or "in a function")
        else:
            yield from _imports(child, where)


def _imports_in(statement: ast.stmt, where: str) -> Iterator[tuple[ast.Import | ast.ImportFrom, str]]:
    if isinstance(statement, ast.Import | ast.ImportFrom):
        yield statement, where
    else:
        yield from _imports(statement, where)


def _base_of_relative(module: str, is_package: bool, level: int) -> str:
    """The package a `from .`-import at `level` starts from, in `module`."""
    parts = module.split(".")
    if not is_package:
        parts.pop()
    if level > 1:
        parts = parts[: len(parts) - (level - 1)]
    return ".".join(parts)


def targets(statement: ast.Import | ast.ImportFrom, module: str, is_package: bool,
            known: dict[str, Path]) -> list[str]:
    """The scanned modules one import statement names (none for third-party and standard modules)."""
    if isinstance(statement, ast.Import):
        return [alias.name for alias in statement.names if alias.name in known]
    base = statement.module or ""
    if statement.level:
        prefix = _base_of_relative(module, is_package, statement.level)
        base = f"{prefix}.{base}" if base and prefix else (base or prefix)
    found = []
    for alias in statement.names:
        submodule = f"{base}.{alias.name}" if base else alias.name
        if submodule in known:
            found.append(submodule)
        elif base in known:
            found.append(base)
    return sorted(set(found))


def import_edges(modules: dict[str, Path]) -> list[Edge]:
    """Every edge between the scanned modules; a module importing itself is left out."""
    edges = []
    for name, path in modules.items():
        is_package = path.name == "__init__.py"
        tree = ast.parse(path.read_text(), filename=str(path))
        for statement, where in _imports(tree):
            for target in targets(statement, name, is_package, modules):
                if target != name:
                    edges.append(Edge(name, target, statement.lineno, where))
    return edges


def strongly_connected(nodes: Iterable[str], edges: Iterable[Edge]) -> list[list[str]]:
    """Tarjan's strongly connected components with more than one module, each sorted, in sorted order."""
    graph: dict[str, set[str]] = {node: set() for node in nodes}
    for edge in edges:
        graph[edge.source].add(edge.target)
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    components: list[list[str]] = []
    for start in sorted(graph):
        if start in index:
            continue
        work = [(start, iter(sorted(graph[start])))]
        index[start] = low[start] = len(index)
        stack.append(start)
        on_stack.add(start)
        while work:
            node, children = work[-1]
            child = next(children, None)
            if child is not None:
                if child not in index:
                    index[child] = low[child] = len(index)
                    stack.append(child)
                    on_stack.add(child)
                    work.append((child, iter(sorted(graph[child]))))
                elif child in on_stack:
                    low[node] = min(low[node], index[child])
                continue
            work.pop()
            if work:
                low[work[-1][0]] = min(low[work[-1][0]], low[node])
            if low[node] == index[node]:
                component = []
                while True:
                    member = stack.pop()
                    on_stack.discard(member)
                    component.append(member)
                    if member == node:
                        break
                if len(component) > 1:
                    components.append(sorted(component))
    return sorted(components)


def find_cycles(packages: Iterable[Path], root: Path, excluded: Sequence[Path] = ()) -> list[list[Edge]]:
    """The import cycles among the files under `packages`: per cycle, the edges between its modules."""
    modules = collect_modules(packages, root, excluded)
    edges = import_edges(modules)
    cycles = []
    for component in strongly_connected(modules, edges):
        members = set(component)
        cycles.append(sorted((e for e in edges if e.source in members and e.target in members),
                             key=lambda e: (e.source, e.line, e.target)))
    return cycles


def describe(cycle: list[Edge], modules: dict[str, Path], root: Path) -> str:
    files = sorted({str(modules[e.source].relative_to(root)) for e in cycle})
    lines = [f"import cycle between {len(files)} files: {', '.join(files)}"]
    for edge in cycle:
        note = f"  ({edge.where})" if edge.where else ""
        lines.append(f"  {modules[edge.source].relative_to(root)}:{edge.line} imports {edge.target}{note}")
    return "\n".join(lines)


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("packages", nargs="+", type=Path, help="package folders, relative to --root")
    parser.add_argument("--exclude", action="append", type=Path, default=[], help="a folder to skip")
    parser.add_argument("--root", type=Path, default=Path("."), help="the folder imports are relative to")
    args = parser.parse_args(argv)
    root = args.root.resolve()
    packages = [root / package for package in args.packages]
    excluded = [root / folder for folder in args.exclude]
    modules = collect_modules(packages, root, excluded)
    cycles = find_cycles(packages, root, excluded)
    for cycle in cycles:
        print(describe(cycle, modules, root))
    if cycles:
        print(f"{len(cycles)} import cycle(s): move what both sides need into a module both can import, "
              "or join the files", file=sys.stderr)
        return 1
    print(f"no import cycle among {len(modules)} files")
    return 0


if __name__ == "__main__":
    sys.exit(main())

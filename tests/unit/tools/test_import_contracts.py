"""The cycle contracts of `make lint` (pyproject.toml, `[tool.importlinter]`) on small package trees written
for each test: import-linter's `acyclic_siblings` and our `own_package` (tools/own_package.py) together find
every cycle between files, through `TYPE_CHECKING` and in-function imports too."""

import itertools

import grimp
import pytest
from importlinter.configuration import configure
from importlinter.contracts.acyclic_siblings import AcyclicSiblingsContract

from tools.own_package import OwnPackageContract

pytestmark = pytest.mark.unit
_names = itertools.count()


@pytest.fixture
def tree(tmp_path, monkeypatch):
    """Writes `{path: text}` as a fresh root package (a new name each time: grimp caches nothing, Python's
    import system does) and returns the graph grimp builds of it, with that name."""
    monkeypatch.syspath_prepend(str(tmp_path))
    configure()  # what `lint-imports` does first: the settings a contract's check reads

    def write(files: dict[str, str]) -> tuple[grimp.ImportGraph, str]:
        root = f"pkg{next(_names)}"
        for name, text in files.items():
            path = tmp_path / name.replace("pkg", root, 1)
            path.parent.mkdir(parents=True, exist_ok=True)
            path.write_text(text.replace("pkg", root))
        return grimp.build_graph(root, cache_dir=None), root
    return write


def cycle_breakers(graph: grimp.ImportGraph, root: str, skip: tuple[str, ...] = ()) -> set[tuple[str, str]]:
    """What `acyclic_siblings` would remove to break the cycles under `root`, as (importer, imported) tails;
    empty when the contract is kept."""
    options = {"ancestors": [root], **({"skip_descendants": [f"{root}.{s}" for s in skip]} if skip else {})}
    check = AcyclicSiblingsContract("cycles", {}, options).check(graph, verbose=False)
    by_package = check.metadata["cycle_breakers_by_package"]
    assert check.kept == (not by_package)
    return {(a.removeprefix(f"{root}."), b.removeprefix(f"{root}.")) for edges in by_package.values()
            for a, b in edges}


def own_package_imports(graph: grimp.ImportGraph, root: str) -> list[tuple[str, str]]:
    check = OwnPackageContract("own", {}, {"containers": [root]}).check(graph, verbose=False)
    assert check.kept == (not check.metadata["imports"])
    return [(m.removeprefix(f"{root}."), p) for m, p, _ in check.metadata["imports"]]


def test_a_clean_tree_keeps_both(tree):
    graph, root = tree({
        "pkg/__init__.py": "",
        "pkg/base.py": "import json\n",
        "pkg/a.py": "from pkg.base import X\nimport numpy\n",
        "pkg/b.py": "from . import a\nfrom .base import Y\n",
    })
    assert cycle_breakers(graph, root) == set() and own_package_imports(graph, root) == []


def test_a_cycle_through_a_type_checking_import_is_found(tree):
    graph, root = tree({
        "pkg/__init__.py": "",
        "pkg/staging.py": ("from typing import TYPE_CHECKING\n"
                           "if TYPE_CHECKING:\n"
                           "    from pkg.channel import C\n"),
        "pkg/channel.py": "from pkg.staging import S\n",
    })
    assert len(cycle_breakers(graph, root)) == 1


def test_typing_dot_type_checking_and_imports_inside_functions_count(tree):
    graph, root = tree({
        "pkg/__init__.py": "",
        "pkg/a.py": "import typing\nif typing.TYPE_CHECKING:\n    import pkg.b\n",
        "pkg/b.py": "def later():\n    from pkg import c\n",
        "pkg/c.py": "from .a import A\n",
    })
    assert len(cycle_breakers(graph, root)) == 1


def test_a_cycle_between_files_of_two_subpackages_is_a_cycle_between_the_subpackages(tree):
    graph, root = tree({
        "pkg/__init__.py": "",
        "pkg/sub/__init__.py": "",
        "pkg/sub/x.py": "from .. import y\n",  # relative, two levels: pkg.y
        "pkg/y.py": "from pkg.sub import x\n",
    })
    assert len(cycle_breakers(graph, root)) == 1


def test_a_package_init_that_re_exports_its_children_is_not_a_cycle(tree):
    graph, root = tree({
        "pkg/__init__.py": "from pkg.a import A\nfrom .b import B\nfrom . import c\n",
        "pkg/a.py": "from pkg.b import B\n",
        "pkg/b.py": "",
        "pkg/c.py": "from .a import A\n",
    })
    assert cycle_breakers(graph, root) == set() and own_package_imports(graph, root) == []


def test_a_child_importing_from_its_re_exporting_init_is_a_cycle_only_own_package_finds(tree):
    graph, root = tree({
        "pkg/__init__.py": "from pkg.a import A\n",
        "pkg/a.py": "def later():\n    from pkg import Shared\n",  # a name of __init__, not a submodule
    })
    assert cycle_breakers(graph, root) == set()  # no two siblings import each other
    assert own_package_imports(graph, root) == [("a", root)]


def test_a_skipped_package_is_left_out(tree):
    graph, root = tree({
        "pkg/__init__.py": "",
        "pkg/_gen/__init__.py": "",
        "pkg/_gen/a.py": "from pkg._gen import b\n",
        "pkg/_gen/b.py": "from pkg._gen import a\n",
    })
    assert cycle_breakers(graph, root) != set()
    assert cycle_breakers(graph, root, skip=("_gen",)) == set()

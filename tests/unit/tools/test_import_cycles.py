"""`tools/import_cycles.py` on small package trees written for each test."""

from pathlib import Path

import pytest

from tools.import_cycles import find_cycles, main

pytestmark = pytest.mark.unit


def write_tree(root: Path, files: dict[str, str]) -> None:
    for name, text in files.items():
        path = root / name
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)


def cycles_in(root: Path, *packages: str, exclude: tuple[str, ...] = ()) -> list[set[tuple[str, str, str]]]:
    """Per cycle, its edges as (importer, imported, where)."""
    found = find_cycles([root / p for p in packages], root, [root / e for e in exclude])
    return [{(e.source, e.target, e.where) for e in cycle} for cycle in found]


def test_a_clean_tree_passes(tmp_path, capsys):
    write_tree(tmp_path, {
        "pkg/__init__.py": "",
        "pkg/base.py": "import json\n",
        "pkg/a.py": "from pkg.base import X\nimport numpy\n",
        "pkg/b.py": "from . import a\nfrom .base import Y\n",
    })
    assert cycles_in(tmp_path, "pkg") == []
    assert main(["pkg", "--root", str(tmp_path)]) == 0
    assert "no import cycle among 4 files" in capsys.readouterr().out


def test_a_cycle_through_a_type_checking_import_is_found(tmp_path, capsys):
    write_tree(tmp_path, {
        "pkg/__init__.py": "",
        "pkg/staging.py": ("from typing import TYPE_CHECKING\n"
                           "if TYPE_CHECKING:\n"
                           "    from pkg.channel import C\n"),
        "pkg/channel.py": "from pkg.staging import S\n",
    })
    assert cycles_in(tmp_path, "pkg") == [{("pkg.staging", "pkg.channel", "TYPE_CHECKING"),
                                           ("pkg.channel", "pkg.staging", "")}]
    assert main(["pkg", "--root", str(tmp_path)]) == 1
    out = capsys.readouterr().out
    assert "import cycle between 2 files: pkg/channel.py, pkg/staging.py" in out
    assert "pkg/staging.py:3 imports pkg.channel  (TYPE_CHECKING)" in out


def test_typing_dot_type_checking_and_imports_inside_functions_count(tmp_path):
    write_tree(tmp_path, {
        "pkg/__init__.py": "",
        "pkg/a.py": "import typing\nif typing.TYPE_CHECKING:\n    import pkg.b\n",
        "pkg/b.py": "def later():\n    from pkg import c\n",
        "pkg/c.py": "from .a import A\n",
    })
    assert cycles_in(tmp_path, "pkg") == [{("pkg.a", "pkg.b", "TYPE_CHECKING"),
                                           ("pkg.b", "pkg.c", "in a function"),
                                           ("pkg.c", "pkg.a", "")}]


def test_a_package_init_that_re_exports_its_children_is_not_a_cycle(tmp_path):
    write_tree(tmp_path, {
        "pkg/__init__.py": "from pkg.a import A\nfrom .b import B\nfrom . import c\n",
        "pkg/a.py": "from pkg.b import B\n",
        "pkg/b.py": "",
        "pkg/c.py": "from .a import A\n",
    })
    assert cycles_in(tmp_path, "pkg") == []


def test_a_child_importing_from_its_re_exporting_init_is_a_cycle(tmp_path):
    write_tree(tmp_path, {
        "pkg/__init__.py": "from pkg.a import A\n",
        "pkg/a.py": "from pkg import Shared\n",  # Shared is a name in __init__, not a submodule
    })
    assert cycles_in(tmp_path, "pkg") == [{("pkg", "pkg.a", ""), ("pkg.a", "pkg", "")}]


def test_from_package_import_submodule_resolves_to_the_submodule(tmp_path):
    write_tree(tmp_path, {
        "pkg/__init__.py": "",
        "pkg/sub/__init__.py": "",
        "pkg/sub/x.py": "from .. import y\n",  # relative, two levels: pkg.y
        "pkg/y.py": "from pkg.sub import x\n",
    })
    assert cycles_in(tmp_path, "pkg") == [{("pkg.sub.x", "pkg.y", ""), ("pkg.y", "pkg.sub.x", "")}]


def test_cycles_across_packages_and_exclusions(tmp_path):
    write_tree(tmp_path, {
        "lib/__init__.py": "",
        "lib/a.py": "import svc.b\n",
        "lib/_gen/__init__.py": "",
        "lib/_gen/pb.py": "import lib.a\n",
        "svc/__init__.py": "",
        "svc/b.py": "from lib import a\nfrom lib._gen import pb\n",
    })
    assert cycles_in(tmp_path, "lib", "svc", exclude=("lib/_gen",)) == [
        {("lib.a", "svc.b", ""), ("svc.b", "lib.a", "")}]
    assert len(cycles_in(tmp_path, "lib", "svc")[0]) == 4  # with pb: a -> b -> pb -> a as well

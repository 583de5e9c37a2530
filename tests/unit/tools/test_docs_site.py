"""The documentation site builds with warnings as errors (`mkdocs build --strict`: a page missing from the
nav, a broken link or anchor between pages), and every relative link of the built site and of the README
resolves (tools/check_links.py; external links are not fetched). Nothing in the repository cites a design
file that is not in it."""

import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from tools.check_links import markdown_problems, site_problems

pytestmark = pytest.mark.unit
ROOT = Path(__file__).resolve().parents[3]


@pytest.fixture(scope="module")
def site(tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("site")
    built = subprocess.run(
        [sys.executable, "-m", "mkdocs", "build", "--strict", "--site-dir", str(out)],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert built.returncode == 0, built.stderr[-4000:]
    return out


def test_the_site_builds_strict_and_every_page_is_there(site):
    for page in (
        "index.html",
        "bring-your-own/index.html",
        "reference/config/index.html",
        "design/index.html",
    ):
        assert (site / page).is_file(), page


def test_every_link_of_the_site_resolves(site):
    assert site_problems(site) == []


def test_the_link_checker_finds_a_broken_link_and_a_missing_anchor(tmp_path):
    (tmp_path / "a.html").write_text('<a href="b.html#there">b</a><a href="c.html">c</a><h1 id="here">')
    (tmp_path / "b.html").write_text('<a href="a.html#here">a</a><a href="https://example.org/x">x</a>')
    assert site_problems(tmp_path) == [
        "a.html: b.html#there (no #there there)",
        "a.html: c.html (no such file)",
    ]


def test_every_relative_link_of_the_readme_resolves():
    assert markdown_problems(ROOT / "README.md") == []


def test_no_file_cites_a_design_file_outside_the_repository():
    git = shutil.which("git")
    if git is None or not (ROOT / ".git").exists():
        pytest.skip("needs git and a checkout")
    cited = subprocess.run(
        [git, "grep", "-l", "DESIGN.md", "--", ":!tests/unit/tools/test_docs_site.py"],
        cwd=ROOT,
        capture_output=True,
        text=True,
    ).stdout
    assert cited.split() == [] or (ROOT / "DESIGN.md").is_file(), f"these cite DESIGN.md: {cited}"


def test_every_config_snippet_of_the_readme_loads(tmp_path):
    from asyncrlhf.config import load_config
    from tools.doc_blocks import parse

    snippets = [b for b in parse((ROOT / "README.md").read_text()) if b.action == "config"]
    assert len(snippets) >= 5
    for i, block in enumerate(snippets):
        path = tmp_path / f"snippet{i}.yaml"
        path.write_text(block.code)
        load_config([path])

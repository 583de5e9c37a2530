"""Run a documentation page's code blocks in order, as a reader following it would.

    python tools/doc_blocks.py docs/bring-your-own.md [--workdir DIR]

What each fenced block of the page does:

    ```bash                       run with `bash -euo pipefail` in the work directory
    ```python                     run with this Python (`python -c`) in the work directory
    ```LANG title="FILE"          written to FILE in the work directory (the reader saves it), not run
    ```yaml                       a config fragment: loaded as a config (`load_config`), so every key it
                                  names must exist in the config tree with a valid value
    ```text / ```console          output shown to the reader: not run

A block is skipped only when the line before its fence says why, e.g. `<!-- docs-test: skip (gpu) -->`
(a GPU node, a network, or minutes of CPU); the page shows the reader the same reason in its prose.

The work directory stands in for the repository root: `configs/` is linked into it, `asyncrlhf` is on PATH
(this Python's scripts) and this checkout's code is imported (PYTHONPATH), so a page's commands run as
written, on this tree. tests/e2e/test_docs_pages.py runs the quickstart, bring-your-own and recipe pages
with it in CI.
"""

from __future__ import annotations

import argparse
import os
import re
import subprocess
import sys
import tempfile
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
FENCE = re.compile(r"^(?P<indent>[ \t]*)```(?P<lang>[\w-]*)(?P<attrs>[^\n`]*)$")
TITLE = re.compile(r'title="(?P<title>[^"]+)"')
SKIP = re.compile(r"<!--\s*docs-test:\s*skip\s*\((?P<reason>[^)]+)\)\s*-->")
RUN = ("bash", "python")
SHOWN = ("text", "console")
KINDS = (*RUN, *SHOWN, "yaml")


@dataclass(frozen=True)
class Block:
    """One fenced block of a page: its language, the file it is saved as (if titled), why it is skipped."""

    line: int  # 1-based line of the opening fence
    lang: str
    code: str
    file: str | None = None
    skip: str | None = None

    @property
    def action(self) -> str:
        """`skip`, `write`, `run`, `config` or `show`."""
        if self.skip:
            return "skip"
        if self.file:
            return "write"
        if self.lang in RUN:
            return "run"
        return "config" if self.lang == "yaml" else "show"


def parse(text: str) -> list[Block]:
    """The fenced blocks of a Markdown page, in order (indented ones inside admonitions and lists too)."""
    lines, blocks, i = text.splitlines(), [], 0
    while i < len(lines):
        opened = FENCE.match(lines[i])
        if not opened or not opened["lang"]:
            i += 1
            continue
        indent, body, start = opened["indent"], [], i
        i += 1
        while i < len(lines) and lines[i].strip() != "```":
            body.append(lines[i][len(indent) :] if lines[i].startswith(indent) else lines[i].lstrip())
            i += 1
        title = TITLE.search(opened["attrs"])
        before = next((lines[j] for j in range(start - 1, -1, -1) if lines[j].strip()), "")
        skip = SKIP.search(before)
        blocks.append(
            Block(
                start + 1,
                opened["lang"],
                "\n".join(body) + "\n",
                title["title"] if title else None,
                skip["reason"].strip() if skip else None,
            )
        )
        i += 1
    return blocks


def problems(blocks: Sequence[Block]) -> list[str]:
    """What makes a page's blocks unrunnable as written: a language this runner does not know."""
    return [
        f'line {b.line}: ```{b.lang} is not one of {", ".join(KINDS)} (or give it a title="FILE")'
        for b in blocks
        if b.action not in ("skip", "write") and b.lang not in KINDS
    ]


def environment() -> dict[str, str]:
    scripts = str(Path(sys.executable).parent)
    path = ROOT if "PYTHONPATH" not in os.environ else f"{ROOT}{os.pathsep}{os.environ['PYTHONPATH']}"
    return {
        **os.environ,
        "PATH": f"{scripts}{os.pathsep}{os.environ.get('PATH', '')}",
        "PYTHONPATH": str(path),
    }


def prepare(workdir: Path) -> None:
    """The work directory as the repository root, as far as the pages' commands reach: `configs/`."""
    workdir.mkdir(parents=True, exist_ok=True)
    link = workdir / "configs"
    if not link.exists():
        link.symlink_to(ROOT / "configs")


def run_block(block: Block, workdir: Path, timeout_s: float = 600) -> subprocess.CompletedProcess | None:
    """Do what `block` asks in `workdir`; returns the process of a block that ran (check its returncode)."""
    action = block.action
    if action in ("skip", "show"):
        return None
    if action == "write":
        target = workdir / block.file  # type: ignore[operator]
        target.parent.mkdir(parents=True, exist_ok=True)
        target.write_text(block.code)
        return None
    if action == "config":
        code = (
            "import sys, tempfile\nfrom asyncrlhf.config import load_config\n"
            "with tempfile.NamedTemporaryFile('w', suffix='.yaml', delete=False) as f:\n"
            "    f.write(sys.stdin.read())\n"
            "load_config([f.name])\n"
        )
        command = [sys.executable, "-c", code]
    else:
        command = (
            ["bash", "-euo", "pipefail", "-c", block.code]
            if block.lang == "bash"
            else [sys.executable, "-c", block.code]
        )
    return subprocess.run(
        command,
        cwd=workdir,
        env=environment(),
        input=block.code if action == "config" else None,
        capture_output=True,
        text=True,
        timeout=timeout_s,
    )


def run_page(page: Path, workdir: Path) -> list[str]:
    """Run every block of `page` in order; stop at the first that fails. Returns what failed (empty: none)."""
    blocks = parse(page.read_text())
    found = problems(blocks)
    if found:
        return found
    prepare(workdir)
    for block in blocks:
        why = f": {block.skip}" if block.skip else ""
        print(f"--- {page.name}:{block.line} ```{block.lang} ({block.action}{why})", flush=True)
        done = run_block(block, workdir)
        if done is None:
            continue
        print(done.stdout[-3000:], done.stderr[-3000:], sep="\n", flush=True)
        if done.returncode != 0:
            return [
                f"{page}:{block.line}: ```{block.lang} exited {done.returncode}\n{block.code}\n"
                f"--- stdout\n{done.stdout[-4000:]}\n--- stderr\n{done.stderr[-4000:]}"
            ]
    return []


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("page", type=Path)
    parser.add_argument("--workdir", type=Path, help="where to run (default: a new temporary directory)")
    args = parser.parse_args(argv)
    workdir = args.workdir or Path(tempfile.mkdtemp(prefix="doc-blocks-"))
    failed = run_page(args.page.resolve(), workdir)
    print(
        "\n".join(failed) or f"every block of {args.page} ran (in {workdir})",
        file=sys.stderr if failed else sys.stdout,
    )
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())

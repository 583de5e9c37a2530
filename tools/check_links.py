"""Check every link of a built documentation site, without the network: each relative `href`/`src` of each
HTML page must name a file of the site, and each `#anchor` an `id` in its page. External links (http, https,
mailto) are listed, not fetched. Also checks the relative links of Markdown files outside the site (the
README): each must name a file of the repository.

Beside MkDocs' own validation (`validation:` in mkdocs.yml, which fails `mkdocs build --strict` on a
Markdown link or anchor between pages that does not resolve), this sees what MkDocs does not: links in raw
HTML, links to files left out of the site (`exclude_docs`), and Markdown outside the site.

    python tools/check_links.py site [README.md ...]      # `make docs` runs it after `mkdocs build --strict`
"""

from __future__ import annotations

import argparse
import re
import sys
from html.parser import HTMLParser
from pathlib import Path
from urllib.parse import unquote, urlsplit

EXTERNAL = ("http:", "https:", "mailto:", "data:", "javascript:")
MARKDOWN_LINK = re.compile(r"\]\(([^)\s]+)\)")


class _Page(HTMLParser):
    def __init__(self) -> None:
        super().__init__()
        self.links: list[str] = []
        self.ids: set[str] = set()

    def handle_starttag(self, tag: str, attrs: list[tuple[str, str | None]]) -> None:
        for name, value in attrs:
            if value is None:
                continue
            if name == "id":
                self.ids.add(value)
            elif name in ("href", "src") and not (
                tag == "link" and name == "href" and "canonical" in str(attrs)
            ):
                self.links.append(value)


def _read(page: Path) -> _Page:
    parsed = _Page()
    parsed.feed(page.read_text(errors="replace"))
    return parsed


def site_problems(site: Path) -> list[str]:
    """`page: link` for every relative link of the site that names no file, or no id in its page."""
    site = site.resolve()
    pages = {p: _read(p) for p in site.rglob("*.html")}
    out = []
    for page, parsed in pages.items():
        for link in parsed.links:
            if link.startswith(EXTERNAL) or link.startswith("//"):
                continue
            parts = urlsplit(link)
            base = site if parts.path.startswith("/") else page.parent  # the 404 page links from the root
            target = page if not parts.path else (base / unquote(parts.path).lstrip("/")).resolve()
            if target.is_dir():
                target = target / "index.html"
            if not target.is_file():
                out.append(f"{page.relative_to(site)}: {link} (no such file)")
            elif parts.fragment and target.suffix == ".html":
                ids = pages[target].ids if target in pages else _read(target).ids
                if unquote(parts.fragment) not in ids:
                    out.append(f"{page.relative_to(site)}: {link} (no #{parts.fragment} there)")
    return out


def markdown_problems(path: Path) -> list[str]:
    """Relative links of a Markdown file that name no file (anchors of other files are not checked)."""
    out = []
    for link in MARKDOWN_LINK.findall(path.read_text()):
        if link.startswith(EXTERNAL) or link.startswith("#"):
            continue
        if not (path.parent / unquote(link.split("#")[0])).exists():
            out.append(f"{path}: {link} (no such file)")
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("site", type=Path)
    parser.add_argument("markdown", type=Path, nargs="*")
    args = parser.parse_args(argv)
    problems = site_problems(args.site) + [p for md in args.markdown for p in markdown_problems(md)]
    print("\n".join(problems) or f"links: every relative link of {args.site} resolves")
    return 1 if problems else 0


if __name__ == "__main__":
    sys.exit(main())

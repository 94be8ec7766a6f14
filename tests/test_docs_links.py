"""Every link between the repository's own documents reaches a file that exists, and where it names a
section, a heading of that file: a section moved to another file must take its links with it."""

from __future__ import annotations

import functools
import re
from pathlib import Path
from urllib.parse import unquote

import pytest
from markdown_it import MarkdownIt

REPO = Path(__file__).resolve().parents[1]
PARSER = MarkdownIt("commonmark").enable("table")


def documents() -> list[Path]:
    """Our Markdown files: the README, docs/ (the benchmark and probe records included), jetson/ and engines/."""
    return sorted([REPO / "README.md", *REPO.glob("docs/**/*.md"), *REPO.glob("jetson/**/*.md"),
                   *REPO.glob("engines/**/*.md")])


def slug(heading: str) -> str:
    """GitHub's anchor for a heading's text: lower case, punctuation dropped (hyphens and underscores
    kept), each space a hyphen."""
    return re.sub(r"[^\w\- ]", "", heading.strip().lower()).replace(" ", "-")


@functools.cache
def anchors(path: Path) -> frozenset[str]:
    """Each heading's anchor, with GitHub's ``-1``, ``-2``... for a repeated one (read once a file: a
    long document is the target of many links)."""
    seen: dict[str, int] = {}
    out = set()
    tokens = PARSER.parse(path.read_text())
    for opening, inline in zip(tokens, tokens[1:], strict=False):
        if opening.type == "heading_open":
            text = "".join(child.content for child in inline.children or [] if child.type in ("text", "code_inline"))
            base = slug(text)
            n = seen.get(base, 0)
            seen[base] = n + 1
            out.add(base if n == 0 else f"{base}-{n}")
    return frozenset(out)


def links(path: Path) -> list[str]:
    """The targets of the file's Markdown links."""
    found = []
    for token in PARSER.parse(path.read_text()):
        for child in token.children or []:
            if child.type == "link_open":
                found.append(str(child.attrs["href"]))
    return found


def local(href: str) -> bool:
    return not re.match(r"[a-z][a-z0-9+.-]*:", href)  # no scheme: http:, mailto: ... are not ours to check


def shown(file: Path) -> str:
    return str(file.relative_to(REPO)) if file.is_relative_to(REPO) else file.name


def broken(path: Path) -> list[str]:
    out = []
    for href in filter(local, links(path)):
        target, _, anchor = unquote(href).partition("#")
        file = (path.parent / target).resolve() if target else path
        if not file.exists():
            out.append(f"{href}: no such file")
        elif anchor and file.suffix == ".md" and anchor not in anchors(file):
            out.append(f"{href}: no heading with that anchor in {shown(file)}")
    return out


def test_the_slug_is_github_s():
    assert slug("Benchmark: `edgeinfer bench gpu --weights`") == "benchmark-edgeinfer-bench-gpu---weights"
    assert slug("The weights in L2 are worth 4% at most") == "the-weights-in-l2-are-worth-4-at-most"
    assert slug("Tried: the staged kernel's bias off x's sums") == "tried-the-staged-kernels-bias-off-xs-sums"


@pytest.mark.parametrize("path", documents(), ids=lambda p: str(p.relative_to(REPO)))
def test_every_local_link_reaches_its_file_and_heading(path):
    assert broken(path) == []


def test_a_link_to_a_moved_section_is_caught(tmp_path):
    (tmp_path / "a.md").write_text("# A\n\n## Kept\n\nSee [b](b.md#moved) and [here](#kept) and [gone](#gone).\n")
    (tmp_path / "b.md").write_text("# B\n\n## Elsewhere\n")
    assert broken(tmp_path / "a.md") == ["b.md#moved: no heading with that anchor in b.md",
                                         "#gone: no heading with that anchor in a.md"]

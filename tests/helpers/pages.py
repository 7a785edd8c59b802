"""The documentation as the tests read it: README.md and the topic pages of docs/. A command block is
found by its page and the heading it stands under, so that a test runs it as written wherever it moves
(tests/system/test_walkthrough.py, tests/{unit,system}/test_api.py), and a page's links and anchors are listed for
tests/unit/test_docs.py."""

from __future__ import annotations

import re
from pathlib import Path

# The repository: the first folder above this file that holds README.md (tests/ now, tests/<tier>/ later).
ROOT = next(p for p in Path(__file__).resolve().parents if (p / "README.md").is_file())
HEADING = re.compile(r"^(#{1,6}) (.+?)\s*$")
LINK = re.compile(r"\[[^\]]*\]\(([^)\s]+)\)")


def pages() -> list[Path]:
    """README.md and every page of docs/."""
    return [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]


def text(page: str) -> str:
    """The page, by its path from the repository's root ("README.md", "docs/configuration.md")."""
    return (ROOT / page).read_text()


def _outside_fences(lines: list[str]):
    """(index, line) of the lines that are not inside a ``` block (nor its fences)."""
    fenced = False
    for i, line in enumerate(lines):
        if line.startswith("```"):
            fenced = not fenced
            continue
        if not fenced:
            yield i, line


def _headings(lines: list[str]):
    """(index, match) of the headings among `lines`."""
    for i, line in _outside_fences(lines):
        if m := HEADING.match(line):
            yield i, m


def section(page: str, heading: str) -> str:
    """What stands under `heading` (its words, without the #s) on `page`, up to the next heading of
    the same level or above. A heading that is not there, or there twice, fails the test that asks."""
    lines = text(page).splitlines()
    found = [(i, len(m.group(1))) for i, m in _headings(lines) if m.group(2) == heading]
    assert len(found) == 1, f"{page}: {len(found)} headings '{heading}' (one expected)"
    start, level = found[0]
    end = next((i for i, m in _headings(lines) if i > start and len(m.group(1)) <= level), len(lines))
    return "\n".join(lines[start + 1 : end]) + "\n"


def block(page: str, heading: str, lang: str = "sh", index: int = 0) -> str:
    """The `index`-th ```lang block under `heading` on `page`, as written (without its fences)."""
    blocks = re.findall(rf"^```{re.escape(lang)}\n(.*?)^```", section(page, heading), re.M | re.S)
    assert len(blocks) > index, f"{page}, '{heading}': no ```{lang} block number {index + 1}"
    return blocks[index]


def slug(heading: str) -> str:
    """GitHub's anchor of a heading: lower case, punctuation but - and _ dropped, spaces made -."""
    return re.sub(r"[^\w\- ]", "", heading.strip().lower()).replace(" ", "-")


def anchors(page: Path) -> set[str]:
    """The anchors a link can name on `page` (a heading met again gets -1, -2, ... as on GitHub)."""
    seen: dict[str, int] = {}
    out = set()
    for _, m in _headings(page.read_text().splitlines()):
        base = slug(m.group(2))
        n = seen.get(base, 0)
        seen[base] = n + 1
        out.add(base if n == 0 else f"{base}-{n}")
    return out


def links(page: Path) -> list[str]:
    """The link targets written on `page`, outside code blocks and `code spans`."""
    out = []
    for _, line in _outside_fences(page.read_text().splitlines()):
        out += LINK.findall(re.sub(r"`[^`]*`", "", line))
    return out

"""The documentation stays whole (issue #43 item 6): README.md is read in ten minutes and links to the
topic pages of docs/; every relative link of those pages leads to a file (and a heading) that exists;
Benchmarks' latest run names the newest results of bench/results/; the exit codes' table is the
outcomes' table. Fast: files read, nothing run."""

from __future__ import annotations

import re
from pathlib import Path
from urllib.parse import unquote

from tests.helpers.pages import ROOT, anchors, links, pages, section, text
from trainer.resilience import outcomes


def broken_links(page: Path) -> list[str]:
    """The relative links of `page` whose file, or heading, is not there."""
    broken = []
    for target in links(page):
        if re.match(r"[a-z][a-z0-9+.-]*:", target):  # https:, mailto: ... (not checked: offline)
            continue
        path, _, anchor = unquote(target).partition("#")
        file = (page.parent / path).resolve() if path else page
        if not file.exists():
            broken.append(f"{page.name}: ({target}): no file {path}")
        elif anchor and (file.suffix != ".md" or anchor not in anchors(file)):
            broken.append(f"{page.name}: ({target}): no heading #{anchor} in {file.name}")
    return broken


def test_every_relative_link_leads_to_a_file_and_heading_that_exist():
    assert [line for page in pages() for line in broken_links(page)] == []


def test_a_broken_link_and_a_missing_anchor_are_found(tmp_path):
    """The check above can fail: a page that links to a missing file and a missing heading (a link
    inside a code block is no link)."""
    page = tmp_path / "page.md"
    text = "# Title\n\n## A run's life\n\n[ok](#a-runs-life) [gone](nothere.md) [`x`](page.md#no-such)\n"
    page.write_text(text + "```\n[in a block](x.md)\n```\n")
    assert broken_links(page) == [
        "page.md: (nothere.md): no file nothere.md",
        "page.md: (page.md#no-such): no heading #no-such in page.md",
    ]


def test_the_readme_is_read_in_ten_minutes_and_names_every_topic_page():
    readme = text("README.md")
    assert len(readme.splitlines()) <= 300, "README.md grew past 300 lines: move the detail to a page of docs/"
    linked = {target.split("#")[0] for target in links(ROOT / "README.md")}
    unlinked = [p.name for p in sorted((ROOT / "docs").glob("*.md")) if f"docs/{p.name}" not in linked]
    assert unlinked == [], "pages of docs/ the README does not link to"


def test_benchmarks_latest_run_names_the_newest_results():
    """The newest date among bench/results/'s files: the section names each of its reports (.md), so
    a newer run that nobody wrote up fails here instead of leaving an old one as "latest"."""
    results = ROOT / "bench" / "results"
    dated = {p.name: p.name[:10] for p in results.iterdir() if re.match(r"\d{4}-\d{2}-\d{2}-", p.name)}
    newest = max(dated.values())
    reports = sorted(name for name, day in dated.items() if day == newest and name.endswith(".md"))
    latest = section("docs/benchmarks.md", "Latest run")
    named = re.findall(r"bench/results/([\w.-]+\.md)", latest)
    assert reports and [r for r in reports if r not in named] == [], f"the newest reports ({newest}) not named"
    assert all((results / name).is_file() for name in named), named
    assert max(name[:10] for name in named) == newest  # nothing named from the future either


def test_every_exit_code_of_the_outcomes_has_its_row_in_the_failures_page():
    table = section("docs/failures.md", "Launching, stopping and exit codes")
    documented = set(re.findall(r"^\| ([^|]+?) \|", table, re.M)) - {"exit code", "---"}
    codes = {str(o.code) for o in outcomes.OUTCOMES if o.code is not None}
    signalled = {"128 + N"} if any(o.code is None for o in outcomes.OUTCOMES) else set()
    assert documented == codes | signalled


def test_every_results_file_has_its_row_on_the_benchmarks_page():
    rows = section("docs/benchmarks.md", "Every results file")
    named = set(re.findall(r"`(\d{4}-\d{2}-\d{2}-[\w-]+)`", rows))
    files = {p.name.rsplit(".", 1)[0] for p in (ROOT / "bench" / "results").iterdir() if p.suffix in (".md", ".json")}
    assert sorted(files - named) == [], "results without a row in docs/benchmarks.md"
    assert sorted(named - files) == [], "rows naming no results file"

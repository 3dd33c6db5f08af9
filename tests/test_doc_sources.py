"""docs/sources.md against the pages and the book's map: every built chapter has three
sources or more, every link to a source names an entry, and each entry's pages are exactly
the pages that cite it."""

from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
DOCS = ROOT / "docs"
SOURCES = DOCS / "sources.md"
PAGES = sorted(DOCS.glob("*.md"))
ENTRY = re.compile(r"^### ([a-z0-9-]+)\n\n(.+?)\n\nSupports: (.+?)\n\nPages: (.+?)\n", re.M | re.S)
CITED = re.compile(r"\]\(sources\.md#([a-z0-9-]+)\)")


def entries() -> dict[str, tuple[str, str, list[str]]]:
    found = {}
    for key, cite, supports, pages in ENTRY.findall(SOURCES.read_text()):
        assert key not in found, f"two entries {key}"
        found[key] = (cite, supports, re.findall(r"\]\(([\w-]+\.md)\)", pages))
    return found


def test_every_built_chapter_has_three_sources_that_exist():
    known = entries()
    assert len(known) >= 45
    text = SOURCES.read_text()
    by_chapter = dict(re.findall(r"^\| (\d+) \| (.*) \|$", text, re.M))
    book = (DOCS / "book.md").read_text()
    status = dict(re.findall(r"^\| (\d+) \|.*\| ([^|]+) \|$", book, re.M))
    assert sorted(map(int, by_chapter)) == list(range(1, 46))
    for n, cell in by_chapter.items():
        keys = re.findall(r"\]\(#([a-z0-9-]+)\)", cell)
        assert all(k in known for k in keys), f"chapter {n}: {keys}"
        if status[n].strip().startswith("built"):
            assert len(set(keys)) >= 3, f"chapter {n} is built and has {len(set(keys))} sources"
    used = {k for cell in by_chapter.values() for k in re.findall(r"\]\(#([a-z0-9-]+)\)", cell)}
    assert used == set(known), f"entries no chapter names: {set(known) - used}"


def test_an_entry_s_pages_are_the_pages_that_cite_it():
    known = entries()
    cited_by: dict[str, set[str]] = {}
    for page in PAGES:
        for key in CITED.findall(page.read_text()):
            assert key in known, f"{page.name} cites {key}, which sources.md does not hold"
            cited_by.setdefault(key, set()).add(page.name)
    for key, (cite, supports, pages) in known.items():
        assert cite and supports and pages, f"{key}: a citation, its claims and its pages"
        assert set(pages) == cited_by.get(key, set()), (
            f"{key} lists {sorted(pages)}, cited by {sorted(cited_by.get(key, set()))}"
        )


def test_the_checker_reads_an_entry():
    text = "### a-2020\n\nA, *T*, 2020.\n\nSupports: x.\n\nPages: [kernels.md](kernels.md).\n"
    assert ENTRY.findall(text) == [("a-2020", "A, *T*, 2020.", "x.", "[kernels.md](kernels.md).")]

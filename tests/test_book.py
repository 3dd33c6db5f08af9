"""docs/book.md, the chapter map, against the book's plan and the tree: each chapter's
number and title are the plan's, every module, command, record and test it names exists,
each record was written by a command its row names, and each chapter's status agrees with
what the row shows. README.md links the map before any other page."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
BOOK = ROOT / "docs" / "book.md"
TICKED = re.compile(r"`([^`]+)`")
RECORD = re.compile(r"\[([^\]]+)\]\(\.\./benchmarks/results/([^)]+)\.json\)")
STATUSES = ("built, measured", "built, measured in part: ", "built, NOT_RUN: ", "not built: ")
# the book's plan and the curriculum, beside the checkout where they are at hand
SEEDS = ROOT.parent / "shared" / "seeds"


def chapters() -> list[dict]:
    rows = []
    chapters_part = BOOK.read_text().partition("## The curriculum")[0]
    for line in chapters_part.splitlines():
        m = re.match(r"\| (\d+) \|", line)
        if not m:
            continue
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        number, title, asks, code, commands, records, tests, status = cells
        rows.append({
            "number": int(number), "title": title, "asks": asks, "code": TICKED.findall(code),
            "commands": TICKED.findall(commands), "records": RECORD.findall(records),
            "tests": TICKED.findall(tests), "status": status,
        })  # fmt: skip
    return rows


ROWS = chapters()


def test_the_map_has_every_chapter_in_eight_parts():
    assert [r["number"] for r in ROWS] == list(range(1, 46))
    assert len(re.findall(r"^## Part [IVX]+: ", BOOK.read_text(), re.M)) == 8
    assert all(r["title"] and r["asks"] and r["code"] and r["tests"] for r in ROWS)


def _seed(marker: str) -> str:
    """The text of the seed document holding marker; skips (saying so) where it is absent."""
    for path in sorted(SEEDS.glob("*.txt")) if SEEDS.is_dir() else []:
        text = path.read_text(errors="replace")
        if marker in text:
            return text
    pytest.skip(f"the book's plan and curriculum are not beside this checkout ({SEEDS})")


def plan() -> tuple[dict[int, str], dict[str, tuple[str, int, int]]]:
    """The plan's chapter titles by number, and its parts (roman -> name, first, last).
    Chapters 1 to 28 are titled in its contents (a title line, then its promise); the
    rest take their topic from the part table."""
    lines = _seed("Chapter plan").splitlines()
    contents = [x.strip() for x in lines[lines.index("Chapters") + 1 :] if x.strip()]
    titles = {i + 1: contents[2 * i] for i in range(len(contents) // 2)}
    parts = {}
    for line in lines:
        m = re.match(r"([IVX]+)\. (.+?)\t(\d+)-(\d+)\t(.+)$", line)
        if not m:
            continue
        first, last = int(m[3]), int(m[4])
        parts[m[1]] = (m[2], first, last)
        topics = m[5].split(", ")
        assert len(topics) == last - first + 1, line
        for n, topic in zip(range(first, last + 1), topics, strict=True):
            titles.setdefault(n, topic[0].upper() + topic[1:])
    return titles, parts


def test_every_chapter_has_the_plan_s_number_and_title():
    titles, _ = plan()
    assert sorted(titles) == list(range(1, 46))
    assert {r["number"]: r["title"] for r in ROWS} == titles


def test_every_part_has_the_plan_s_name_and_chapters():
    _, parts = plan()
    found = re.findall(
        r"^## Part ([IVX]+): (.+) \(chapters (\d+) to (\d+)\)$", BOOK.read_text(), re.M
    )
    assert {p: (name, int(a), int(b)) for p, name, a, b in found} == parts


def test_the_curriculum_s_articles_keep_their_numbers_and_titles():
    text = _seed("| 00. The roadmap |")
    want = re.findall(r"^\| (\d\d)\. (.+?) \|", text, re.M)
    rows = re.findall(r"^\| (\d\d)\. (.+?) \| ([\d, ]+|all, in order) \|", BOOK.read_text(), re.M)
    assert [(n, t) for n, t, _ in rows] == want
    for _, _, chapters in rows:  # each names chapters of the map
        assert chapters == "all, in order" or all(1 <= int(c) <= 45 for c in chapters.split(", "))
    curriculum = BOOK.read_text().partition("## The curriculum")[2]
    for module in TICKED.findall(curriculum):
        assert (ROOT / "src" / "tokenworks" / module).is_file() or (ROOT / module).is_file(), module


def _subcommands() -> set[tuple[str, ...]]:
    """Every `tokenworks` command path the CLI takes: ("bench", "serve"), ("profile",) ..."""
    import argparse

    from tokenworks.cli import build_parser

    found: set[tuple[str, ...]] = set()

    def walk(parser: argparse.ArgumentParser, path: tuple[str, ...]) -> None:
        for action in parser._actions:
            if isinstance(action, argparse._SubParsersAction):
                for name, sub in action.choices.items():
                    found.add((*path, name))
                    walk(sub, (*path, name))

    walk(build_parser(), ())
    return found


SUBCOMMANDS = _subcommands()


def _exists(command: str) -> bool:
    words = command.split()
    if words[0] == "tokenworks":
        path = tuple(w for w in words[1:] if not w.startswith("-"))
        return path in SUBCOMMANDS
    if words[0] in ("python", "bash"):
        return (ROOT / words[1]).is_file()
    return False


def _signature(command: str) -> str:
    """What a record's command line holds when this command wrote it."""
    words = command.split()
    return " ".join(words[1:]) if words[0] == "tokenworks" else words[1]


@pytest.mark.parametrize("row", ROWS, ids=[f"chapter-{r['number']}" for r in ROWS])
def test_every_name_in_a_chapter_exists(row):
    for module in row["code"]:
        assert (ROOT / "src" / "tokenworks" / module).is_file(), f"no module {module}"
    for command in row["commands"]:
        assert _exists(command), f"no command {command}"
    for test in row["tests"]:
        path, _, name = test.partition("::")
        assert (ROOT / path).is_file(), f"no test file {path}"
        if name:
            assert f"def {name}(" in (ROOT / path).read_text(), f"no test {test}"
    for text, name in row["records"]:
        assert text == name, f"the link to {name} reads {text}"
        record = ROOT / "benchmarks" / "results" / f"{name}.json"
        assert record.is_file(), f"no record {name}"
        written_by = json.loads(record.read_text())["command"]
        assert any(_signature(c) in written_by for c in row["commands"]), (
            f"{name} was written by {written_by!r}, not by {row['commands']}"
        )


@pytest.mark.parametrize("row", ROWS, ids=[f"chapter-{r['number']}" for r in ROWS])
def test_a_chapter_s_status_agrees_with_its_row(row):
    status = row["status"]
    assert status.startswith(STATUSES), f"chapter {row['number']}: status {status!r}"
    if status.startswith("built, measured"):
        assert row["records"], "measured, but no record is linked"
    if status != "built, measured":
        assert len(status.split(": ", 1)[1]) > 20, "a status short of measured says why"


def test_the_checker_catches_a_missing_name():
    assert not _exists("tokenworks bench no-such-bench")
    assert not _exists("python labs/no_such_lab.py")
    assert _exists("tokenworks bench serve") and _exists("tokenworks profile")


def test_the_readme_links_the_map_before_any_other_page():
    readme = (ROOT / "README.md").read_text()
    first = re.search(r"docs/[\w-]+\.md", readme)
    assert first and first.group(0) == "docs/book.md"


def test_the_package_s_chapter_table_is_the_map_s():
    from tokenworks.book import CHAPTERS, chapters_of

    assert CHAPTERS == {
        r["number"]: (r["title"], tuple(dict.fromkeys(_signature(c) for c in r["commands"])))
        for r in ROWS
    }
    for row in ROWS:  # each record the map names is filed under its chapter
        for _, name in row["records"]:
            record = json.loads((ROOT / "benchmarks" / "results" / f"{name}.json").read_text())
            assert row["number"] in chapters_of(record["command"]), name

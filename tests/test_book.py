"""docs/book.md, the chapter map, against the tree: every module, command, record and test
it names exists, each record was written by a command its row names, and each chapter's
status agrees with what the row shows. README.md links the map before any other page."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
BOOK = ROOT / "docs" / "book.md"
TICKED = re.compile(r"`([^`]+)`")
RECORD = re.compile(r"\[([^\]]+)\]\(\.\./benchmarks/results/([^)]+)\.json\)")
STATUSES = ("built, measured", "built, NOT_RUN: ", "not built: ")


def chapters() -> list[dict]:
    rows = []
    for line in BOOK.read_text().splitlines():
        m = re.match(r"\| (\d+) \|", line)
        if not m:
            continue
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        number, asks, code, commands, records, tests, status = cells
        rows.append({
            "number": int(number), "asks": asks, "code": TICKED.findall(code),
            "commands": TICKED.findall(commands), "records": RECORD.findall(records),
            "tests": TICKED.findall(tests), "status": status,
        })  # fmt: skip
    return rows


ROWS = chapters()


def test_the_map_has_every_chapter_in_eight_parts():
    assert [r["number"] for r in ROWS] == list(range(1, 46))
    assert len(re.findall(r"^## Part [IVX]+: ", BOOK.read_text(), re.M)) == 8
    assert all(r["asks"] and r["code"] and r["tests"] for r in ROWS)


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
    if status == "built, measured":
        assert row["records"], "measured, but no record is linked"
    else:
        assert len(status.split(": ", 1)[1]) > 20, "a status short of measured says why"


def test_the_checker_catches_a_missing_name():
    assert not _exists("tokenworks bench no-such-bench")
    assert not _exists("python labs/no_such_lab.py")
    assert _exists("tokenworks bench serve") and _exists("tokenworks profile")


def test_the_readme_links_the_map_before_any_other_page():
    readme = (ROOT / "README.md").read_text()
    first = re.search(r"docs/[\w-]+\.md", readme)
    assert first and first.group(0) == "docs/book.md"

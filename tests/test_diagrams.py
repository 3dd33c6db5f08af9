"""docs/diagrams/: every module a diagram names exists, the curriculum holds every chapter
of docs/book.md and only those, and the page that draws them is written from the sources."""

from __future__ import annotations

import importlib.util
import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
HERE = ROOT / "docs" / "diagrams"
SOURCES = sorted(HERE.glob("*.mmd"))
PATH = re.compile(r"\b((?:[a-z_]+/)+(?:[a-z_]+\.py)?)")  # engine/kv_cache.py, serve/


def named_paths(text: str) -> list[str]:
    """The module paths a diagram's nodes and edges name (not its %% comments)."""
    drawn = re.sub(r"^\s*%%.*$", "", text, flags=re.M).replace("<br/>", " ")
    return PATH.findall(drawn)


@pytest.mark.parametrize("source", SOURCES, ids=[s.name for s in SOURCES])
def test_every_module_a_diagram_names_exists(source):
    paths = named_paths(source.read_text())
    assert paths or source.name == "curriculum.mmd", f"{source.name} names no module"
    for path in paths:
        assert (ROOT / "src" / "tokenworks" / path).exists(), f"{source.name}: no {path}"


def test_the_checker_catches_a_missing_module():
    assert named_paths('a["engine/nothing_here.py"]') == ["engine/nothing_here.py"]
    assert not (ROOT / "src" / "tokenworks" / "engine/nothing_here.py").exists()


def test_the_curriculum_holds_every_chapter():
    nodes = set(re.findall(r"\bch(\d+)\b", (HERE / "curriculum.mmd").read_text()))
    chapters = re.findall(r"^\| (\d+) \|", (ROOT / "docs" / "book.md").read_text(), re.M)
    assert sorted(map(int, nodes)) == sorted(map(int, chapters)) == list(range(1, 46))


def test_the_page_is_written_from_the_sources():
    spec = importlib.util.spec_from_file_location("render", HERE / "render.py")
    render = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(render)
    assert set(render.DIAGRAMS) == {s.name for s in SOURCES}
    assert (HERE / "README.md").read_text() == render.page(), (
        "docs/diagrams/README.md is out of date: run python docs/diagrams/render.py"
    )


def test_the_architecture_page_draws_the_floors_as_the_source_has_them():
    page = (ROOT / "docs" / "architecture.md").read_text()
    assert (HERE / "floors.mmd").read_text().strip() in page

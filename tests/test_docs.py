"""Every number README.md or a docs/ page quotes is produced by code or held by a record.

A measured figure is written [12.3](../benchmarks/results/RECORD.json#json/path*factor): the
link text must equal the value at that path of that record (times the factor), rounded to
the digits the page shows. A prediction is shown as a ```console block starting with
`$ tokenworks plan ...`: the command is run again and must print exactly what the page
shows. Change a record, the code or a page and this says where they disagree.
"""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
LINK = re.compile(r"\[([-0-9.,]+)\]\(((?:\.\./)?benchmarks/results/[^)#]+)#([^)]+)\)")
PAGES = sorted((ROOT / "docs").glob("*.md")) + [ROOT / "README.md"]
CONSOLE = re.compile(r"```console\n\$ (tokenworks plan [^\n]+)\n(.*?)```", re.S)


def value_at(record: dict, fragment: str) -> float:
    path, _, factor = fragment.partition("*")
    value = record
    for key in path.split("/"):
        value = value[int(key)] if isinstance(value, list) else value[key]
    return float(value) * (float(factor) if factor else 1.0)


def quoted(page: Path) -> list[tuple[str, str, str]]:
    return LINK.findall(page.read_text())


# pages that map the others (chapters, terms, sources) and quote no figures of their own
MAPS = {"book.md", "glossary.md", "sources.md"}


@pytest.mark.parametrize("page", PAGES, ids=[p.name for p in PAGES])
def test_every_quoted_number_is_what_its_record_holds(page):
    links = quoted(page)
    # every page backs its numbers: links to records, or `tokenworks plan` outputs (below)
    backed = links or CONSOLE.search(page.read_text()) or page.name in MAPS
    assert backed, f"{page.name} backs no number"
    for text, target, fragment in links:
        record_path = (page.parent / target).resolve()
        assert record_path.exists(), f"{page.name}: {target} does not exist"
        value = value_at(json.loads(record_path.read_text()), fragment)
        shown = text.replace(",", "")
        decimals = len(shown.split(".")[1]) if "." in shown else 0
        assert round(value, decimals) == pytest.approx(float(shown)), (
            f"{page.name} quotes {text} for {target}#{fragment}, but the record holds {value}"
        )


def test_the_checker_catches_a_wrong_number(tmp_path):
    record = {"results": {"runs": [{"x": 0.1234}]}}
    assert value_at(record, "results/runs/0/x*1000") == pytest.approx(123.4)
    assert LINK.findall("[1,005](../benchmarks/results/a.json#r/0/x*1000)") == [
        ("1,005", "../benchmarks/results/a.json", "r/0/x*1000")
    ]


# a figure: a number followed by x (attached: "1.3x", not the product "32 x 128"), tok/s,
# ms, GB or %
NUMBER = r"(?<![\w.,])(?:\d{1,3}(?:,\d{3})+|\d+)(?:\.\d+)?"
FIGURE = re.compile(NUMBER + r"(?:[x\u00d7]|\s?(?:tok/s|ms|GB|%))(?!\w)")
ANY_LINK = re.compile(r"\[([^\]]*)\]\(([^)]*)\)")
ARITHMETIC = "<!-- arithmetic -->"  # a line whose figures are computed, not measured


def _units(text: str):
    """A page's prose sentences and table rows (code blocks and table headers left out)."""
    text = re.sub(r"```.*?```", "", text, flags=re.S)
    for para in re.split(r"\n\s*\n", text):
        lines = para.splitlines()
        if para.lstrip().startswith("|"):
            header = [i + 1 < len(lines) and lines[i + 1].lstrip().startswith("|-")
                      for i in range(len(lines))]  # fmt: skip
            yield from (row for row, h in zip(lines, header, strict=True) if not h)
            continue
        for item in re.split(r"\n(?=\s*(?:[-*]|\d+\.) )", para):  # list items apart
            yield from re.split(r"(?<=[.;!?])\s+(?=[A-Z(*`\[])", item)


def unbacked_figures(text: str) -> list[str]:
    """The sentences and table rows of a page that quote a figure yet link no record (nor a
    report pooled from records, nor for a vendor's figure its source) and are not marked as
    arithmetic."""
    found = []
    for unit in _units(text):
        if any(s in unit for s in ("benchmarks/results/", "benchmarks/report/", "sources.md#")):
            continue
        if ARITHMETIC in unit:
            continue
        bare = ANY_LINK.sub(lambda m: m.group(1), re.sub(r"<!--.*?-->", "", unit))
        if FIGURE.search(re.sub(r"`[^`]*`", "", bare)):
            found.append(" ".join(unit.split()))
    return found


@pytest.mark.parametrize("page", PAGES, ids=[p.name for p in PAGES])
def test_every_figure_sits_beside_its_record_or_is_marked_arithmetic(page):
    if page.name in MAPS:
        return
    assert not unbacked_figures(page.read_text()), page.name


def test_the_figure_check_finds_a_bare_figure():
    assert unbacked_figures("Decode runs at 12.5 tok/s. The rest is prose.") == [
        "Decode runs at 12.5 tok/s."
    ]
    assert not unbacked_figures("It is [1.3](../benchmarks/results/r.json#a)x faster.")
    assert not unbacked_figures("Four layers of 2 GB are 8 GB. <!-- arithmetic -->")
    assert not unbacked_figures("A batch of 32 x 128 tokens, 4,096 in all.")


PLAN_PAGES = [p for p in PAGES if CONSOLE.search(p.read_text())]


@pytest.mark.parametrize("page", PLAN_PAGES, ids=[p.name for p in PLAN_PAGES])
def test_every_plan_output_a_page_shows_is_what_the_code_prints(page, capsys):
    """A page's `tokenworks plan` examples are run again; their output must not drift."""
    import shlex

    from tokenworks.cli import main

    for command, shown in CONSOLE.findall(page.read_text()):
        main(shlex.split(command)[1:])
        printed = capsys.readouterr().out
        assert printed.strip() == shown.strip(), f"{page.name}: `{command}` now prints:\n{printed}"

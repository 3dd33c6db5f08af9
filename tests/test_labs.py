"""Every lab the book's map lists runs in its fast mode (`--fast`): it prints its result
and writes an evidence record (and its figure). The figures of a fast run mean nothing;
that the lab runs from a clean checkout, and records what it ran, is what this holds."""

from __future__ import annotations

import json
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
LABS = sorted(set(re.findall(r"`python (labs/\w+\.py)`", (ROOT / "docs" / "book.md").read_text())))


def test_the_map_lists_every_lab():
    assert LABS == sorted(f"labs/{p.name}" for p in (ROOT / "labs").glob("*.py"))


@pytest.mark.parametrize("lab", LABS, ids=[Path(lab).stem for lab in LABS])
def test_a_lab_runs_fast_and_writes_its_record(lab, tmp_path):
    done = subprocess.run(
        [sys.executable, lab, "--fast", "--out", str(tmp_path)],
        cwd=ROOT, capture_output=True, text=True, timeout=600,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr[-3000:]
    assert done.stdout.strip(), "a lab prints its result"
    records = [json.loads(p.read_text()) for p in tmp_path.glob("*.json")]
    assert len(records) == 1, sorted(p.name for p in tmp_path.iterdir())
    record = records[0]
    assert record["kind"].startswith("lab") and "--fast" in record["command"]
    assert record["results"] and record["git"]["commit"]

"""The shape of the source tree, held by a test: small files with one job, and command-line
layers whose functions a reader takes in at once."""

from __future__ import annotations

import ast
from pathlib import Path

SRC = Path(__file__).resolve().parents[1] / "src" / "tokenworks"
MAX_FILE_LINES = 500  # a Python file (the C kernels under kernels/csrc aside)
MAX_PARSER_FUNCTION_LINES = 80
# where the commands and their flags are made
PARSERS = ["cli.py", "bench/parsers.py", "bench/configs.py", "bench/shared_options.py",
           "plan/commands.py", "plan/configs.py", "options.py"]  # fmt: skip


def test_no_source_file_is_over_500_lines():
    long = sorted(
        (len(p.read_text().splitlines()), str(p.relative_to(SRC)))
        for p in SRC.rglob("*.py")
        if len(p.read_text().splitlines()) > MAX_FILE_LINES
    )
    assert not long, f"split these by what they do: {long}"


def test_no_function_of_the_command_line_layers_is_over_80_lines():
    long = []
    for name in PARSERS:
        for node in ast.walk(ast.parse((SRC / name).read_text())):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                lines = node.end_lineno - node.lineno + 1
                if lines > MAX_PARSER_FUNCTION_LINES:
                    long.append((name, node.name, lines))
    assert not long, f"functions to shorten: {long}"


def test_one_loop_steps_the_engine():
    """Generation, streaming, the warm-up, the benchmarks and the labs step an engine
    through engine/loop.py's EngineLoop, as the server's core does: nothing else calls
    an engine's step()."""
    root = SRC.parents[1]
    callers = []
    for path in [
        *SRC.rglob("*.py"),
        *(root / "labs").glob("*.py"),
        *(root / "benchmarks").glob("*.py"),
    ]:
        if path == SRC / "engine" / "loop.py":
            continue
        for node in ast.walk(ast.parse(path.read_text())):
            if (
                isinstance(node, ast.Call)
                and isinstance(node.func, ast.Attribute)
                and node.func.attr == "step"
                and ast.unparse(node.func.value).split(".")[-1] in ("engine", "eng")
            ):
                callers.append(f"{path.relative_to(root)}:{node.lineno}")
    assert not callers, f"step these through an EngineLoop: {callers}"


MAX_POSITIONAL_FIELDS = 6  # a record built by position past this swaps fields silently


def _records() -> set[str]:
    """The names of src's dataclasses and msgspec Structs."""
    names = set()
    for path in SRC.rglob("*.py"):
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            if not isinstance(node, ast.ClassDef):
                continue
            marks = [ast.unparse(d) for d in node.decorator_list]
            bases = [ast.unparse(b) for b in node.bases]
            if any(m.startswith("dataclass") for m in marks) or any(
                b.split(".")[-1] == "Struct" for b in bases
            ):
                names.add(node.name)
    return names


def test_records_are_built_by_keyword():
    records, found = _records(), []
    assert {"EngineGauges", "Ready", "RequestMetrics"} <= records
    for path in SRC.rglob("*.py"):
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            if not isinstance(node, ast.Call):
                continue
            name = getattr(node.func, "id", None) or getattr(node.func, "attr", None)
            if name in records and len(node.args) > MAX_POSITIONAL_FIELDS:
                found.append(f"{path.relative_to(SRC)}:{node.lineno} {name}")
    assert not found, found

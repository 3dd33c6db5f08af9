"""The layering of the source tree, held by a test: a new upward import fails here.

Lower layers never import higher ones: ops/ (torch building blocks) imports nothing of
tokenworks; kernels/ only ops/ and paths; models/ the kernels too (a GGUF's blocks); the
engine never the server; plan/ only units and the torch-free shapes module, so the planners
run without torch.
"""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

import pytest

SRC = Path(__file__).resolve().parents[1] / "src" / "tokenworks"
# package (or top-level module) -> the tokenworks packages and modules it may import
ALLOWED = {
    "units": set(),
    "paths": set(),
    "shapes": {"units"},
    "ops": set(),
    "kernels": {"ops", "paths"},
    # models keeps a GGUF's blocks as the C kernels' BlockLinear (kernels/block_linear.py)
    "models": {"kernels", "ops", "paths", "shapes", "units"},
    "tokenizer": {"models"},
    "config": {"kernels", "models"},
    "engine": {"config", "kernels", "models", "ops", "plan", "shapes", "tokenizer", "units"},
    "llm": {"config", "engine", "models"},
    "plan": {"shapes", "units"},
    "serve": {"config", "engine", "models", "tokenizer", "units"},
    # bench measures layers below the engine directly too (one MoE layer, one attention)
    "bench": {
        "config",
        "engine",
        "eval",
        "kernels",
        "models",
        "ops",
        "paths",
        "plan",
        "serve",
        "shapes",
        "tokenizer",
        "top",
        "units",
    },  # fmt: skip
    "env_report": {"bench", "kernels", "paths"},
    "eval": {"engine", "ops"},
    "cli": {"bench", "config", "env_report", "models", "plan", "serve", "top", "units"},
    "top": {"engine", "llm"},
}


def imports() -> dict[str, set[tuple[str, str]]]:
    """layer -> {(imported layer, importing file)} for every tokenworks import."""
    found: dict[str, set[tuple[str, str]]] = {}
    for path in SRC.rglob("*.py"):
        parts = path.relative_to(SRC).with_suffix("").parts
        layer = "top" if parts == ("__init__",) else parts[0]
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Import):
                names = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
                names = [node.module]
            else:
                continue
            for name in names:
                if name == "tokenworks":
                    found.setdefault(layer, set()).add(("top", path.name))
                elif name.startswith("tokenworks."):
                    target = name.split(".")[1]
                    if target != layer:
                        found.setdefault(layer, set()).add((target, path.name))
    return found


def test_every_layer_is_known():
    layers = {p.stem if p.is_file() else p.name for p in SRC.iterdir() if p.suffix in ("", ".py")}
    layers = {"top" if x == "__init__" else x for x in layers if x != "__pycache__"}
    assert layers <= set(ALLOWED), f"add {sorted(layers - set(ALLOWED))} to ALLOWED"


@pytest.mark.parametrize("layer", sorted(ALLOWED))
def test_no_layer_imports_above_itself(layer):
    bad = sorted((t, f) for t, f in imports().get(layer, ()) if t not in ALLOWED[layer])
    assert not bad, f"{layer} imports {bad}: not allowed by the layering"


def test_the_checker_sees_a_forbidden_import(tmp_path, monkeypatch):
    (tmp_path / "ops").mkdir()
    (tmp_path / "ops" / "x.py").write_text("from tokenworks.engine import engine\n")
    monkeypatch.setattr(sys.modules[__name__], "SRC", tmp_path)
    assert imports()["ops"] == {("engine", "x.py")}


def test_the_planners_and_shapes_import_without_torch():
    code = (
        "import sys; import tokenworks.plan.commands, tokenworks.shapes, tokenworks.units; "
        "assert 'torch' not in sys.modules, 'torch was imported'"
    )
    subprocess.run([sys.executable, "-c", code], check=True)

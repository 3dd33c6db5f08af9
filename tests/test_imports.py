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
    "book": set(),
    "paths": {"environment"},
    "shapes": {"units"},
    "ops": set(),
    "kernels": {"environment", "lazy", "ops", "paths"},
    # models keeps a GGUF's blocks as the C kernels' BlockLinear (kernels/block_linear.py)
    "models": {"kernels", "lazy", "ops", "paths", "shapes", "units"},
    "tokenizer": {"models"},
    "environment": set(),
    "extras": set(),
    "lazy": set(),
    "options": set(),
    "config": {"kernels", "models", "options"},
    "engine": {
        "config",
        "kernels",
        "lazy",
        "models",
        "ops",
        "plan",
        "shapes",
        "tokenizer",
        "units",
    },  # fmt: skip
    # the fronts: what the API process holds of an engine (the engine never imports them)
    "front": {"config", "engine", "models", "tokenizer", "units"},
    "llm": {"config", "engine", "front", "models"},
    "plan": {"options", "shapes", "units"},
    "serve": {"book", "config", "engine", "front", "models", "options", "tokenizer", "units"},
    # bench measures layers below the engine directly too (one MoE layer, one attention)
    "bench": {
        "config",
        "engine",
        "environment",
        "eval",
        "front",
        "kernels",
        "models",
        "ops",
        "options",
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
    "cli": {
        "bench",
        "config",
        "env_report",
        "environment",
        "extras",
        "front",  # kv-index follows an engine's events as a router would
        "models",
        "options",
        "plan",
        "serve",
        "top",
        "units",
    },  # fmt: skip
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
            elif isinstance(node, ast.ImportFrom) and node.module == "tokenworks":
                # `from tokenworks import environment` imports a module, not the package's
                # top (`from tokenworks import LLM`)
                layers = {p.stem for p in SRC.glob("*.py")} | {p.name for p in SRC.iterdir()}
                names = [f"tokenworks.{a.name}" if a.name in layers else "tokenworks"
                         for a in node.names]  # fmt: skip
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


def _tokenworks_imports(path: Path) -> list[str]:
    """The modules a file imports (at its top or inside functions)."""
    found = []
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            found += [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            found.append(node.module)
    return found


def test_the_engine_runs_without_an_event_loop():
    """The core and the engine it drives speak no asyncio; the fronts (front/) do."""
    bad = [(p.name, n) for p in (SRC / "engine").rglob("*.py")
           for n in _tokenworks_imports(p) if n == "asyncio"]  # fmt: skip
    assert not bad, f"engine modules importing asyncio: {sorted(bad)}"


# what the server may know of the engine: the front interface (front/), and the words it
# speaks (a request's parameters, its updates and errors)
ENGINE_WORDS = {"tokenworks.engine.request", "tokenworks.engine.messages"}


def test_the_server_reaches_the_engine_through_the_front_alone():
    bad = sorted(
        (p.name, n)
        for p in (SRC / "serve").rglob("*.py")
        for n in _tokenworks_imports(p)
        if n.startswith("tokenworks.engine") and n not in ENGINE_WORDS
    )
    assert not bad, f"serve/ modules importing engine internals: {bad}"


def _module_imports() -> tuple[dict[str, set[str]], dict[str, set[str]]]:
    """module -> tokenworks modules it imports at its top, and inside functions."""
    root = SRC.parent

    def name(path: Path) -> str:
        parts = path.relative_to(root).with_suffix("").parts
        return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)

    modules = {name(p): p for p in SRC.rglob("*.py")}
    top: dict[str, set[str]] = {}
    inner: dict[str, set[str]] = {}

    def targets(node) -> list[str]:
        if isinstance(node, ast.Import):
            found = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            found = [node.module, *(f"{node.module}.{a.name}" for a in node.names)]
        else:
            return []
        return [f for f in found if f in modules]

    for module, path in modules.items():
        tree = ast.parse(path.read_text())
        top[module] = {t for node in tree.body for t in targets(node)}
        # imports under `if TYPE_CHECKING` run in no process
        type_only = {
            id(n)
            for node in tree.body
            if isinstance(node, ast.If) and getattr(node.test, "id", "") == "TYPE_CHECKING"
            for n in ast.walk(node)
        }
        inner[module] = {
            t
            for node in ast.walk(tree)
            if id(node) not in type_only
            for t in targets(node)
            if t not in top[module]
        }
    return top, inner


def import_circles(top: dict[str, set[str]], inner: dict[str, set[str]]) -> list[list[str]]:
    """The modules that import each other round a circle, whether the imports sit at the
    top or inside functions (an import inside a function only hides a circle)."""
    edges: dict[str, set[str]] = {}
    for module in top:
        for target in top[module] | inner[module]:
            # importing a.b.c runs a.b's __init__ too, but a module's own packages are
            # already running when it is imported
            parts = target.split(".")
            runs = {".".join(parts[:k]) for k in range(2, len(parts) + 1)}
            own = {".".join(module.split(".")[:k]) for k in range(1, module.count(".") + 2)}
            edges.setdefault(module, set()).update(m for m in runs - own if m in top)
    order, low, stack, on, circles = {}, {}, [], set(), []

    def visit(v: str) -> None:  # Tarjan's strongly connected components
        order[v] = low[v] = len(order)
        stack.append(v)
        on.add(v)
        for w in edges.get(v, ()):
            if w not in order:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], order[w])
        if low[v] == order[v]:
            part = []
            while not part or part[-1] != v:
                part.append(stack.pop())
                on.discard(part[-1])
            if len(part) > 1:
                circles.append(sorted(part))

    for module in sorted(edges):
        if module not in order:
            visit(module)
    return circles


def test_no_modules_import_each_other_even_inside_functions():
    """A circle of imports, even one closed by an import inside a function, is a module
    that should be split: the test looks inside functions too."""
    circles = import_circles(*_module_imports())
    assert not circles, f"modules that import each other: {circles}"


def test_the_circle_checker_sees_one_closed_inside_a_function():
    top = {"tokenworks.a": {"tokenworks.b"}, "tokenworks.b": set(), "tokenworks.c": set()}
    inner = {"tokenworks.a": set(), "tokenworks.b": {"tokenworks.a"}, "tokenworks.c": set()}
    assert import_circles(top, inner) == [["tokenworks.a", "tokenworks.b"]]


def test_the_environment_is_read_in_one_module_only():
    """os.environ.get, os.getenv, os.environ[...] and `in os.environ` appear in
    environment.py alone (copying the environment for a child process is no read)."""
    reads = []
    for path in SRC.rglob("*.py"):
        if path.name == "environment.py" and path.parent == SRC:
            continue
        for node in ast.walk(ast.parse(path.read_text())):
            environ = lambda n: ast.unparse(n) == "os.environ"  # noqa: E731
            if isinstance(node, ast.Call) and ast.unparse(node.func) in (
                "os.environ.get", "os.getenv", "os.environ.setdefault", "os.environ.pop",
            ):  # fmt: skip
                reads.append((path.name, node.lineno))
            elif isinstance(node, ast.Subscript) and environ(node.value):
                reads.append((path.name, node.lineno))
            elif isinstance(node, ast.Compare) and any(environ(c) for c in node.comparators):
                reads.append((path.name, node.lineno))
    assert not reads, f"the environment read outside environment.py: {sorted(reads)}"


def test_the_servers_api_process_imports_no_torch():
    """What the API process of `tokenworks serve` runs (the CLI, the app, the engine's
    front, a model's spec and tokenizer read without weights) needs no torch: the engine
    core, in its own process, holds it."""
    code = (
        "import sys; import tokenworks.cli, tokenworks.serve.server, tokenworks.serve.app; "
        "from tokenworks.front.core_client import CoreClient; "
        "from tokenworks.models import load; from tokenworks.tokenizer import TokenizerWrapper; "
        "TokenizerWrapper.from_loaded(load('toy', weights=False)).encode('hi'); "
        "assert 'torch' not in sys.modules, 'torch was imported'"
    )
    subprocess.run([sys.executable, "-c", code], check=True)

"""Write docs/diagrams/README.md: each Mermaid source here, in a `mermaid` block, which the
usual code hosts draw. No SVG renderer is pinned: Mermaid's own command-line renderer
installs from npm with a headless browser, not from the Python package index.

    python docs/diagrams/render.py
"""

from __future__ import annotations

from pathlib import Path

HERE = Path(__file__).resolve().parent
DIAGRAMS = {  # source -> what it shows
    "stages.mmd": "The stage table: a request to a measured outcome, each stage in its package.",
    "floors.mmd": "The floors of the source tree, and which may import which.",
    "request-path.mmd": "A request's path through the processes: the API process, the "
    "engine cores (one per replica), their workers.",
    "engine-step.mmd": "One engine step, `LLMEngine.step()`.",
    "kv-block-lifecycle.mmd": "A KV block from free to shared, cached, evicted and copied back.",
    "curriculum.mmd": "The book's ideas and what each builds on (chapter numbers as in "
    "[the book's map](../book.md)).",
}


def page() -> str:
    parts = [
        "# Diagrams\n",
        "Mermaid sources (`*.mmd`), drawn below; `python docs/diagrams/render.py` writes this",
        "page from them, and `tests/test_diagrams.py` fails when it is out of date, when a",
        "diagram names a module that does not exist, or when the curriculum leaves out a",
        "chapter.\n",
    ]
    for name, what in DIAGRAMS.items():
        source = (HERE / name).read_text().strip()
        parts += [f"## [{name}]({name})\n", f"{what}\n", "```mermaid", source, "```\n"]
    return "\n".join(parts)


if __name__ == "__main__":
    (HERE / "README.md").write_text(page())

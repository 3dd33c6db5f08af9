"""The /lab page's data: the evidence records in a folder (`--records-dir`), each with the
command that wrote it, its plot and the book's chapters it measures, and the reports
`tokenworks bench report` wrote there (Markdown with its PNGs).

Only files directly in the folder are served, and only records, plots and reports by
their suffix: a name with a path in it, or any other file, is not found.
"""

from __future__ import annotations

import json
from pathlib import Path

from tokenworks.book import CHAPTERS, chapters_of

MEDIA_TYPES = {
    ".json": "application/json",
    ".png": "image/png",
    ".md": "text/markdown; charset=utf-8",
}


def _summary(path: Path) -> dict | None:
    """A record's listing entry (None: not a JSON object, so not a record)."""
    try:
        record = json.loads(path.read_text())
    except (OSError, UnicodeDecodeError, json.JSONDecodeError):
        return None
    if not isinstance(record, dict):
        return None
    command = str(record.get("command") or "")
    model = record.get("model")
    results = record.get("results")
    plot = path.with_suffix(".png")
    return {
        "name": path.name,
        "kind": str(record.get("kind") or path.stem.split("-20")[0]),
        "created_unix": record.get("created_unix"),
        "command": command,
        "commit": (record.get("git") or {}).get("commit"),
        "model": model.get("id") if isinstance(model, dict) else None,
        "status": results.get("status") if isinstance(results, dict) else None,
        "plot": plot.name if plot.is_file() else None,
        "chapters": [{"number": n, "title": CHAPTERS[n][0]} for n in chapters_of(command)],
    }


class RecordsFolder:
    """A folder of records, read when asked (each record parsed again only if changed)."""

    def __init__(self, path: str | Path | None):
        self.path = Path(path) if path else None
        self._seen: dict[str, tuple[tuple[int, int], dict | None]] = {}

    def listing(self) -> dict:
        folder = self.path
        if folder is None or not folder.is_dir():
            return {"folder": str(folder) if folder else None, "found": False, "records": [],
                    "reports": []}  # fmt: skip
        records, reports = [], []
        for f in sorted(folder.iterdir()):
            if not f.is_file():
                continue
            if f.suffix == ".json":
                st = f.stat()
                key = (st.st_mtime_ns, st.st_size)
                seen = self._seen.get(f.name)
                if seen is None or seen[0] != key:
                    seen = self._seen[f.name] = (key, _summary(f))
                if seen[1] is not None:
                    records.append(seen[1])
            elif f.suffix == ".md":
                reports.append({"name": f.name, "modified_unix": f.stat().st_mtime})
        records.sort(key=lambda r: r["created_unix"] or 0, reverse=True)
        return {"folder": str(folder), "found": True, "records": records, "reports": reports}

    def file(self, name: str) -> Path | None:
        """The folder's file of that name, if it is one the page may read."""
        if self.path is None or "/" in name or "\\" in name or name.startswith("."):
            return None
        if Path(name).suffix not in MEDIA_TYPES:
            return None
        path = self.path / name
        if not path.is_file() or path.resolve().parent != self.path.resolve():
            return None
        return path

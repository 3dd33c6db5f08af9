"""Where tokenworks keeps what it fetches and builds: $TOKENWORKS_HOME, or ~/.cache/tokenworks."""

from __future__ import annotations

from pathlib import Path

from tokenworks import environment


def home() -> Path:
    """The cache root: model files, converted weights and built kernels live under it."""
    return Path(environment.get("TOKENWORKS_HOME") or Path.home() / ".cache" / "tokenworks")

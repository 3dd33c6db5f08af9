"""Where tokenworks keeps what it fetches and builds: $TOKENWORKS_HOME, or ~/.cache/tokenworks."""

from __future__ import annotations

import os
from pathlib import Path


def home() -> Path:
    """The cache root: model files, converted weights and built kernels live under it."""
    return Path(os.environ.get("TOKENWORKS_HOME", Path.home() / ".cache" / "tokenworks"))

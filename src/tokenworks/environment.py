"""The environment variables tokenworks reads, all of them here.

Each names a default that a flag or an argument overrides; none carries an option of the
engine, the server or a benchmark (those are fields of their config dataclasses), and none
passes anything between parts of tokenworks. Every evidence record holds the ones set
(bench/record.py), and a test fails on a read of the environment anywhere else.
"""

from __future__ import annotations

import os

VARIABLES = {
    "TOKENWORKS_HOME": "the cache root: model files, kept GGUF indexes, built kernels "
    "(default ~/.cache/tokenworks)",
    "TOKENWORKS_PEERS": "the default of --peers-dir: where benchmarks/peers.sh put the peer "
    "engines (default ./peers)",
    "CC": "the C compiler the kernels are built with (default cc, else gcc)",
}


def get(name: str, default: str | None = None) -> str | None:
    """The variable's value where it is set (and not empty), else `default`."""
    if name not in VARIABLES:
        raise KeyError(f"{name} is not one of the variables tokenworks reads: {list(VARIABLES)}")
    return os.environ.get(name) or default


def snapshot() -> dict[str, str]:
    """The variables set, for a record."""
    return {name: os.environ[name] for name in VARIABLES if os.environ.get(name)}

"""Speculative decoding: proposers guess, the target checks every guess in one pass, and
the acceptance rule keeps the output the target's own (docs/speculative.md).

Names resolve on first use: the running totals (metrics.py) travel to the server's API
process, which imports nothing of the rest (nor torch).
"""

_HOMES = {
    "DraftModelError": "tokenworks.engine.speculative.proposers",
    "open_speculator": "tokenworks.engine.speculative.proposers",
    "SpeculativeMetrics": "tokenworks.engine.speculative.metrics",
    "Speculator": "tokenworks.engine.speculative.speculator",
}


def __getattr__(name: str):
    home = _HOMES.get(name)
    if home is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    import importlib

    return getattr(importlib.import_module(home), name)


__all__ = list(_HOMES)

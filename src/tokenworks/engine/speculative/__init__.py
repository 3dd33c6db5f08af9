"""Speculative decoding: proposers guess, the target checks every guess in one pass, and
the acceptance rule keeps the output the target's own (docs/speculative.md).

Names resolve on first use: the running totals (metrics.py) travel to the server's API
process, which imports nothing of the rest (nor torch).
"""

from tokenworks.lazy import lazy_names

_HOMES = {
    "DraftModelError": "tokenworks.engine.speculative.proposers",
    "open_speculator": "tokenworks.engine.speculative.proposers",
    "SpeculativeMetrics": "tokenworks.engine.speculative.metrics",
    "Speculator": "tokenworks.engine.speculative.speculator",
}


__getattr__ = lazy_names(__name__, _HOMES)

__all__ = list(_HOMES)

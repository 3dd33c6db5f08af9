"""Speculative decoding: proposers guess, the target checks every guess in one pass, and
the acceptance rule keeps the output the target's own (docs/speculative.md)."""

from tokenworks.engine.speculative.proposers import DraftModelError, open_speculator
from tokenworks.engine.speculative.speculator import SpeculativeMetrics, Speculator

__all__ = ["DraftModelError", "SpeculativeMetrics", "Speculator", "open_speculator"]

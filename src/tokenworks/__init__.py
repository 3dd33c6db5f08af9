"""tokenworks: an LLM inference engine, server and measurement lab, from first principles.

`from tokenworks import LLM, SamplingParams` loads the engine (and torch) on first use, so
the torch-free parts (`tokenworks.plan`, `tokenworks.shapes`, `tokenworks.units`) import
without it.
"""

from __future__ import annotations

import importlib

__version__ = "0.1.0"
_LAZY = {
    "LLM": "tokenworks.llm",
    "FinishReason": "tokenworks.engine.request",
    "RequestOutput": "tokenworks.engine.request",
    "SamplingParams": "tokenworks.engine.request",
    "run_node": "tokenworks.engine.workers",  # a machine's share of the ranks (--node-rank)
}
__all__ = ["LLM", "FinishReason", "RequestOutput", "SamplingParams", "run_node", "__version__"]


def __getattr__(name: str):
    if name in _LAZY:
        return getattr(importlib.import_module(_LAZY[name]), name)
    raise AttributeError(f"module 'tokenworks' has no attribute {name!r}")

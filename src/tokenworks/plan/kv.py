"""KV cache size for the planners: tokenworks/shapes.py computes it."""

from __future__ import annotations

from tokenworks.shapes import kv_bytes, kv_bytes_per_token

__all__ = ["kv_bytes", "kv_bytes_per_token"]

"""KV cache size: bytes per token and per sequence, for every attention kind.

Per token and layer a cache holds K and V for each KV head (MHA: every head; GQA: a group's
shared head; MQA: one), or for multi-head latent attention the compressed latent plus the
decoupled RoPE key (DeepSeek caches kv_lora_rank + qk_rope_head_dim numbers). A sliding-
window layer never holds more than its window.
"""

from __future__ import annotations

from tokenworks.plan.models import ModelShape
from tokenworks.units import dtype_bytes


def kv_bytes_per_token(
    model: ModelShape, kv_dtype: str = "bf16", layers: int | None = None
) -> float:
    """Bytes one token of context adds to the cache (window not reached), over all layers
    or the first `layers` (a pipeline stage's share)."""
    b = dtype_bytes(kv_dtype)
    return sum(model.kv_elements_per_token(i) for i in range(layers or model.n_layers)) * b


def kv_bytes(
    model: ModelShape, context: int, kv_dtype: str = "bf16", layers: int | None = None
) -> float:
    """Bytes one sequence's cache holds at `context` tokens (sliding windows capped), over
    all layers or the first `layers`."""
    if context < 0:
        raise ValueError("context must be >= 0 tokens")
    b = dtype_bytes(kv_dtype)
    total = 0.0
    for i in range(layers or model.n_layers):
        tokens = min(context, model.sliding_window) if model.is_local(i) else context
        total += tokens * model.kv_elements_per_token(i) * b
    return total

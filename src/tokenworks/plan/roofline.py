"""Roofline ceilings for a decode step and a prefill, and which roof each one hits.

A step's time is at least max(bytes moved / bandwidth, FLOPs / peak). Decode moves every
active weight once per step plus each sequence's KV cache, and does 2 FLOPs per weight per
sequence plus attention; so it is memory-bound until the batch is large enough that the
arithmetic per byte (the intensity) reaches the device's ridge point, peak / bandwidth.
Prefill does the same weight read for P tokens at once and is compute-bound for all but
the shortest prompts. An MoE step reads only the experts its tokens route to: with B
tokens each picking k of E experts, E * (1 - (1 - k/E)^B) of them on average.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass

from tokenworks.plan.hardware import Hardware
from tokenworks.plan.kv import kv_bytes
from tokenworks.plan.models import ModelShape
from tokenworks.plan.quant import QuantScheme


@dataclass
class Ceiling:
    phase: str  # decode or prefill
    batch: int  # sequences in the step (prefill: 1)
    tokens: int  # tokens computed in the step
    context: int
    weight_bytes: float
    kv_bytes: float
    flops: float
    intensity: float  # FLOP per byte
    ridge: float  # the device's FLOP per byte
    memory_time_s: float
    compute_time_s: float
    step_time_s: float
    bound: str  # memory or compute
    tokens_per_s: float  # in total
    tokens_per_s_per_seq: float

    def to_dict(self) -> dict:
        return asdict(self)


def expected_experts(model: ModelShape, tokens: int) -> float:
    """Routed experts a step touches per MoE layer, on average (uniform routing)."""
    e, k = model.n_experts, model.experts_per_token
    return e * (1 - (1 - k / e) ** tokens)


def step_weight_params(model: ModelShape, tokens: int) -> float:
    """Parameters read from memory in a step of `tokens` tokens: every matrix, except
    the rows of an untied embedding table that no token looks up, and (MoE) the experts
    no token routes to."""
    n = model.params()
    if not model.tie_embeddings:  # the LM head is read whole; the input table by row
        n -= max(0, model.vocab - tokens) * model.hidden
    if not model.is_moe:
        return n
    width = model.moe_intermediate or model.intermediate
    per_expert = (3 if model.mlp == "gated" else 2) * model.hidden * width
    unused = (model.n_experts - expected_experts(model, tokens)) * per_expert
    return n - model.moe_layers * unused


def _ceiling(phase, batch, tokens, context, w_bytes, kv, flops, hw, dtype) -> Ceiling:
    moved = w_bytes + kv
    t_mem = moved / hw.bandwidth
    t_cmp = flops / hw.peak(dtype)
    t = max(t_mem, t_cmp)
    new = batch if phase == "decode" else tokens
    return Ceiling(
        phase=phase,
        batch=batch,
        tokens=tokens,
        context=context,
        weight_bytes=w_bytes,
        kv_bytes=kv,
        flops=flops,
        intensity=flops / moved,
        ridge=hw.ridge(dtype),
        memory_time_s=t_mem,
        compute_time_s=t_cmp,
        step_time_s=t,
        bound="memory" if t_mem >= t_cmp else "compute",
        tokens_per_s=new / t,
        tokens_per_s_per_seq=(1 / t) if phase == "decode" else new / t,
    )


def decode(
    model: ModelShape,
    hw: Hardware,
    scheme: QuantScheme,
    *,
    batch: int = 1,
    context: int = 1024,
    kv_dtype: str = "bf16",
    compute_dtype: str = "bf16",
) -> Ceiling:
    """One decode step: `batch` sequences, each adding a token at `context` tokens."""
    if batch < 1 or context < 1:
        raise ValueError("batch and context must be >= 1")
    w = step_weight_params(model, batch) * scheme.bits_per_weight / 8
    kv = batch * kv_bytes(model, context, kv_dtype)
    flops = batch * (2 * model.matmul_params() + model.attention_flops_per_token(context))
    return _ceiling("decode", batch, batch, context, w, kv, flops, hw, compute_dtype)


def prefill(
    model: ModelShape,
    hw: Hardware,
    scheme: QuantScheme,
    *,
    prompt: int = 512,
    kv_dtype: str = "bf16",
    compute_dtype: str = "bf16",
) -> Ceiling:
    """One prompt of `prompt` tokens in one pass (its KV written once, causal attention)."""
    if prompt < 1:
        raise ValueError("prompt must be >= 1 token")
    w = step_weight_params(model, prompt) * scheme.bits_per_weight / 8
    kv = kv_bytes(model, prompt, kv_dtype)
    # token i attends to i + 1 keys: sum over the prompt of attention at context i + 1
    positions = _sample_positions(prompt)
    attn = sum(model.attention_flops_per_token(i + 1) for i in positions) * (
        prompt / len(positions)
    )
    flops = prompt * 2 * model.matmul_params() + attn
    return _ceiling("prefill", 1, prompt, prompt, w, kv, flops, hw, compute_dtype)


def _sample_positions(n: int, most: int = 256) -> list[int]:
    """Positions to average attention cost over (all of them for short prompts)."""
    if n <= most:
        return list(range(n))
    step = n / most
    return [int((i + 0.5) * step) for i in range(most)]


def ridge_batch(
    model: ModelShape,
    hw: Hardware,
    scheme: QuantScheme,
    *,
    context: int = 1024,
    kv_dtype: str = "bf16",
    compute_dtype: str = "bf16",
    limit: int = 1 << 16,
) -> int | None:
    """The smallest decode batch that is compute-bound (None: KV reads keep it
    memory-bound at every batch up to `limit`)."""
    lo, hi = 1, limit
    if decode(model, hw, scheme, batch=hi, context=context, kv_dtype=kv_dtype,
              compute_dtype=compute_dtype).bound == "memory":  # fmt: skip
        return None
    while lo < hi:
        mid = (lo + hi) // 2
        c = decode(model, hw, scheme, batch=mid, context=context, kv_dtype=kv_dtype,
                   compute_dtype=compute_dtype)  # fmt: skip
        if c.bound == "compute":
            hi = mid
        else:
            lo = mid + 1
    return lo

"""Phi-3 and Phi-4 (phi3): Llama's layout with Q, K and V in one matrix and the gate and
up projections in another, in the files as in the engine (where every family's are
fused); a window over every layer where the config gives one."""

from __future__ import annotations

from tokenworks.models.arch.family import Family

QKV = ("self_attn.q_proj.weight", "self_attn.k_proj.weight", "self_attn.v_proj.weight")
GATE_UP = ("mlp.gate_proj.weight", "mlp.up_proj.weight")
GGUF_BLOCK = {
    "attn_norm.weight": "input_layernorm.weight",
    "ffn_norm.weight": "post_attention_layernorm.weight",
    "attn_qkv.weight": QKV,
    "attn_q.weight": QKV[0],  # (files converted with separate Q, K and V)
    "attn_k.weight": QKV[1],
    "attn_v.weight": QKV[2],
    "attn_output.weight": "self_attn.o_proj.weight",
    "ffn_up.weight": GATE_UP,  # gate rows first, then up
    "ffn_down.weight": "mlp.down_proj.weight",
}


def _spec_fields(cfg: dict) -> dict:
    rope = cfg.get("rope_parameters") or cfg.get("rope_scaling") or {}
    if float(rope.get("partial_rotary_factor", cfg.get("partial_rotary_factor", 1.0))) != 1.0:
        raise ValueError("partial rotary embeddings (Phi-4-mini) are not supported")
    return {"sliding_window": cfg.get("sliding_window")}


def _split(weights: dict, spec) -> dict:
    """Hugging Face's fused qkv_proj and gate_up_proj as the engine's separate names."""
    q, kv, i = spec.q_size, spec.kv_size, spec.intermediate_size
    fused = {"self_attn.qkv_proj.weight": (QKV, (0, q, q + kv, q + 2 * kv)),
             "mlp.gate_up_proj.weight": (GATE_UP, (0, i, 2 * i))}  # fmt: skip
    out = {}
    for name, w in weights.items():
        found = next((f for f in fused if name.endswith(f)), None)
        if found is None:
            out[name] = w
            continue
        names, cuts = fused[found]
        prefix = name.removesuffix(found)
        out |= {prefix + n: w[a:b] for n, a, b in zip(names, cuts, cuts[1:], strict=False)}
    return out


FAMILY = Family(
    name="phi3",
    hf_model_types=("phi3",),
    spec_fields=_spec_fields,
    gguf_archs=("phi3",),
    gguf_block=GGUF_BLOCK,
    prepare=_split,
)

"""Llama 2/3, SmolLM2, Mistral (sliding window) and Qwen2 (QKV bias): the names every
other decoder family's are mapped onto; and Mixtral as llama.cpp writes it (a llama GGUF
with experts)."""

from __future__ import annotations

from tokenworks.models.arch.family import Family
from tokenworks.models.spec import MoESpec

# GGUF per-block tensor names -> engine names (llama.cpp's naming)
GGUF_BLOCK = {
    "attn_norm.weight": "input_layernorm.weight",
    "ffn_norm.weight": "post_attention_layernorm.weight",
    "attn_q.weight": "self_attn.q_proj.weight",
    "attn_k.weight": "self_attn.k_proj.weight",
    "attn_v.weight": "self_attn.v_proj.weight",
    "attn_q.bias": "self_attn.q_proj.bias",
    "attn_k.bias": "self_attn.k_proj.bias",
    "attn_v.bias": "self_attn.v_proj.bias",
    "attn_output.weight": "self_attn.o_proj.weight",
    "ffn_gate.weight": "mlp.gate_proj.weight",
    "ffn_up.weight": "mlp.up_proj.weight",
    "ffn_down.weight": "mlp.down_proj.weight",
}

# llama.cpp writes Mixtral as "llama" with experts: each layer's in one 3-D tensor per matrix
EXPERT_GGUF = {
    "ffn_gate_inp.weight": "mlp.gate.weight",
    "ffn_gate_exps.weight": "mlp.experts.{e}.gate_proj.weight",
    "ffn_up_exps.weight": "mlp.experts.{e}.up_proj.weight",
    "ffn_down_exps.weight": "mlp.experts.{e}.down_proj.weight",
}


def with_experts(block: dict[str, str]) -> dict[str, str]:
    """A layer's GGUF names with the dense MLP's replaced by the router and the stacked
    experts (Qwen2-MoE, Qwen3-MoE)."""
    dense = ("ffn_gate.", "ffn_up.", "ffn_down.")
    return {k: v for k, v in block.items() if not k.startswith(dense)} | EXPERT_GGUF


def _gguf_fields(get, arch: str) -> dict:
    experts = get(f"{arch}.expert_count")
    if not experts:
        return {}
    moe = MoESpec(
        n_experts=int(experts),
        top_k=int(get(f"{arch}.expert_used_count")),
        intermediate=int(get(f"{arch}.feed_forward_length")),
        scoring="softmax",
        norm_topk_prob=True,
    )
    return {"moe": moe}


FAMILY = Family(
    name="llama",
    hf_model_types=("llama", "mistral", "qwen2"),
    gguf_archs=("llama", "qwen2", "mistral"),
    gguf_block=GGUF_BLOCK | EXPERT_GGUF,
    gguf_fields=_gguf_fields,
)

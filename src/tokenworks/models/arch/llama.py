"""Llama 2/3, SmolLM2, Mistral (sliding window) and Qwen2 (QKV bias): the names every
other decoder family's are mapped onto."""

from __future__ import annotations

from tokenworks.models.arch.family import Family

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

FAMILY = Family(
    name="llama",
    hf_model_types=("llama", "mistral", "qwen2"),
    gguf_archs=("llama", "qwen2", "mistral"),
    gguf_block=GGUF_BLOCK,
)

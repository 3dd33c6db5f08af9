"""Qwen3 (dense): Llama's layout with an RMSNorm over each head of Q and of K before RoPE,
and no QKV bias."""

from __future__ import annotations

from tokenworks.models.arch.family import Family
from tokenworks.models.arch.llama import GGUF_BLOCK as LLAMA_GGUF

GGUF_BLOCK = LLAMA_GGUF | {
    "attn_q_norm.weight": "self_attn.q_norm.weight",
    "attn_k_norm.weight": "self_attn.k_norm.weight",
}

FAMILY = Family(
    name="qwen3",
    hf_model_types=("qwen3",),
    spec_fields=lambda cfg: {"qk_norm": True},
    gguf_archs=("qwen3",),
    gguf_block=GGUF_BLOCK,
    gguf_fields=lambda get, arch: {"qk_norm": True},
)

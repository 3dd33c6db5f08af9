"""OLMo 2: Llama's layout with its norms moved after the sublayers (each sublayer reads
the residual stream as it is; its output is normed before it joins), and an RMSNorm over
all of Q and all of K (not each head) before RoPE."""

from __future__ import annotations

from tokenworks.models.arch.family import Family
from tokenworks.models.arch.llama import GGUF_BLOCK as LLAMA_GGUF

FIELDS = {"pre_norms": False, "sandwich_norms": True, "qk_norm": True, "qk_norm_whole": True}
# OLMo 2's post_attention_layernorm follows attention (Llama's name means the MLP's input)
RENAMES = (
    (r"\.post_attention_layernorm\.", ".attn_output_norm."),
    (r"\.post_feedforward_layernorm\.", ".mlp_output_norm."),
)
GGUF_BLOCK = {
    k: v for k, v in LLAMA_GGUF.items() if k not in ("attn_norm.weight", "ffn_norm.weight")
} | {
    "attn_q_norm.weight": "self_attn.q_norm.weight",
    "attn_k_norm.weight": "self_attn.k_norm.weight",
    "post_attention_norm.weight": "attn_output_norm.weight",
    "post_ffw_norm.weight": "mlp_output_norm.weight",
}

FAMILY = Family(
    name="olmo2",
    hf_model_types=("olmo2",),
    spec_fields=lambda cfg: dict(FIELDS),
    hf_renames=RENAMES,
    gguf_archs=("olmo2",),
    gguf_block=GGUF_BLOCK,
    gguf_fields=lambda get, arch: dict(FIELDS),
)

"""Gemma 2 and Gemma 3 (text): Llama's layout with four norms a layer (before and after
attention, before and after the MLP), norms that multiply by (1 + w), a GeGLU MLP,
embeddings scaled by sqrt(hidden), queries by query_pre_attn_scalar**-0.5, and windowed
layers interleaved with global ones (Gemma 2: alternate; Gemma 3: five to one, with their
own RoPE base). Gemma 2 soft-caps attention scores and logits; Gemma 3 normalises each
head of Q and K instead.

Hugging Face stores the norms as w and multiplies by (1 + w); llama.cpp's GGUF stores
1 + w. The engine keeps 1 + w (`prepare` adds the 1 to Hugging Face weights), so its
RMSNorm is the plain one.
"""

from __future__ import annotations

from tokenworks.models.arch.family import Family
from tokenworks.models.arch.llama import GGUF_BLOCK as LLAMA_GGUF

# Gemma's post_attention_layernorm follows attention; its pre_feedforward_layernorm is
# what Llama calls post_attention_layernorm. Renamed in this order.
RENAMES = (
    (r"\.post_attention_layernorm\.", ".attn_output_norm."),
    (r"\.pre_feedforward_layernorm\.", ".post_attention_layernorm."),
    (r"\.post_feedforward_layernorm\.", ".mlp_output_norm."),
)
GGUF_BLOCK = {k: v for k, v in LLAMA_GGUF.items() if k != "ffn_norm.weight"} | {
    "attn_q_norm.weight": "self_attn.q_norm.weight",
    "attn_k_norm.weight": "self_attn.k_norm.weight",
    "post_attention_norm.weight": "attn_output_norm.weight",
    "ffn_norm.weight": "post_attention_layernorm.weight",
    "post_ffw_norm.weight": "mlp_output_norm.weight",
}
GEMMA3_PATTERN = 6  # every 6th layer global


def window_layers(layer_types: list[str] | None, n_layers: int, pattern: int) -> tuple:
    if layer_types:
        return tuple(i for i, t in enumerate(layer_types) if t == "sliding_attention")
    return tuple(i for i in range(n_layers) if (i + 1) % pattern)


def _common(cfg: dict, pattern: int) -> dict:
    return dict(
        sandwich_norms=True,
        mlp_act="gelu_tanh",
        embed_scale=cfg["hidden_size"] ** 0.5,
        attn_scale=cfg.get("query_pre_attn_scalar", cfg.get("head_dim", 256)) ** -0.5,
        sliding_window=cfg.get("sliding_window"),
        window_layers=window_layers(
            cfg.get("layer_types"),
            cfg["num_hidden_layers"],
            cfg.get("sliding_window_pattern") or cfg.get("_sliding_window_pattern") or pattern,
        ),  # fmt: skip
        attn_softcap=cfg.get("attn_logit_softcapping"),
        final_softcap=cfg.get("final_logit_softcapping"),
    )


def _gemma3(cfg: dict) -> dict:
    """Gemma 3's global layers may scale RoPE (4B and up: linear, factor 8; the loader
    reads that from rope_parameters["full_attention"]); its windowed layers never do."""
    rope = cfg.get("rope_parameters") or {}
    full, local = rope.get("full_attention", {}), rope.get("sliding_attention", {})
    if local.get("rope_type", "default") != "default":
        raise ValueError(f"Gemma 3 windowed-layer rope scaling {local!r} is not supported")
    return _common(cfg, GEMMA3_PATTERN) | dict(
        qk_norm=True,
        rope_theta=float(full.get("rope_theta", cfg.get("rope_theta", 1e6))),
        rope_local_theta=float(local.get("rope_theta", cfg.get("rope_local_base_freq", 1e4))),
    )


def _gemma2(cfg: dict) -> dict:
    return _common(cfg, 2)


def _gguf_common(get, arch: str, pattern: int) -> dict:
    """What llama.cpp assumes of a Gemma file rather than reads from it: the layer pattern
    and the query scale (head_dim**-0.5, but (hidden / heads)**-0.5 for the 27B models,
    told apart by their layer count, as llama.cpp does); and <end_of_turn> as a stop."""
    n = int(get(f"{arch}.block_count"))
    tokens = get("tokenizer.ggml.tokens") or []
    hidden, heads = int(get(f"{arch}.embedding_length")), int(get(f"{arch}.attention.head_count"))
    head_dim = int(get(f"{arch}.attention.key_length") or hidden // heads)
    big = n == {2: 46, GEMMA3_PATTERN: 62}[pattern]  # Gemma 2 27B, Gemma 3 27B
    return dict(
        sandwich_norms=True, mlp_act="gelu_tanh", embed_scale=hidden**0.5,
        window_layers=window_layers(None, n, pattern),
        attn_scale=(hidden // heads if big else head_dim) ** -0.5,
        stop_token_ids=tuple(i for i, t in enumerate(tokens) if t == "<end_of_turn>"),
    )  # fmt: skip


def _gemma3_gguf(get, arch: str) -> dict:
    """Gemma 3 also normalises Q and K per head; its windowed layers rotate with their own
    base, `rope.freq_base_swa` (10,000 in files written before the key, as llama.cpp
    assumes)."""
    local = float(get(f"{arch}.rope.freq_base_swa") or 1e4)
    return _gguf_common(get, arch, GEMMA3_PATTERN) | dict(qk_norm=True, rope_local_theta=local)


def _gemma2_gguf(get, arch: str) -> dict:
    """Gemma 2 soft-caps scores and logits; a file without a window has Gemma 2's 4,096."""
    return _gguf_common(get, arch, 2) | dict(
        sliding_window=int(get(f"{arch}.attention.sliding_window") or 4096),
        attn_softcap=get(f"{arch}.attn_logit_softcapping"),
        final_softcap=get(f"{arch}.final_logit_softcapping"),
    )


def add_one_to_norms(weights: dict, spec) -> dict:
    return {k: v + 1.0 if k.endswith("norm.weight") else v for k, v in weights.items()}


GEMMA3 = Family(
    name="gemma3",
    hf_model_types=("gemma3_text",),
    spec_fields=_gemma3,
    hf_renames=RENAMES,
    gguf_archs=("gemma3",),
    gguf_block=GGUF_BLOCK,
    gguf_fields=_gemma3_gguf,
    gguf_keys={"rope.freq_base_swa": "RoPE's base in the windowed layers"},
    prepare=add_one_to_norms,
)
GEMMA2 = Family(
    name="gemma2",
    hf_model_types=("gemma2",),
    spec_fields=_gemma2,
    hf_renames=RENAMES,
    gguf_archs=("gemma2",),
    gguf_block=GGUF_BLOCK,
    gguf_fields=_gemma2_gguf,
    gguf_keys={
        "attn_logit_softcapping": "attention scores soft-capped: cap * tanh(s / cap)",
        "final_logit_softcapping": "logits soft-capped: cap * tanh(l / cap)",
    },
    prepare=add_one_to_norms,
)
FAMILIES = (GEMMA2, GEMMA3)

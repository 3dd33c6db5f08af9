"""IBM Granite 3 (dense) and Granite MoE (3.x MoE, with or without a shared expert): Llama's
layout with four multipliers in place of Llama's constants: the embedding rows times one,
each sublayer's output times another as it joins the residual, the attention scores times a
third (not head_dim**-0.5) and the logits divided by the fourth."""

from __future__ import annotations

from tokenworks.models.arch.family import Family
from tokenworks.models.arch.llama import GGUF_BLOCK as LLAMA_GGUF
from tokenworks.models.arch.llama import with_experts
from tokenworks.models.spec import MoESpec

# the converter's keys for the multipliers -> the ModelSpec fields they set
KEYS = {
    "embedding_scale": ("embed_scale", "the embedding's multiplier"),
    "residual_scale": ("residual_scale", "the sublayers' multiplier as they join the residual"),
    "attention.scale": ("attn_scale", "the attention scores' multiplier"),
    "logit_scale": ("logit_scale", "the logits' divisor"),
}
CONFIG = {
    "embedding_multiplier": "embed_scale",
    "residual_multiplier": "residual_scale",
    "attention_multiplier": "attn_scale",
    "logits_scaling": "logit_scale",
}
MOE_GGUF = with_experts(LLAMA_GGUF) | {
    "ffn_gate_shexp.weight": "mlp.shared_experts.gate_proj.weight",
    "ffn_up_shexp.weight": "mlp.shared_experts.up_proj.weight",
    "ffn_down_shexp.weight": "mlp.shared_experts.down_proj.weight",
}


def _spec_fields(cfg: dict) -> dict:
    return {field: float(cfg[key]) for key, field in CONFIG.items() if cfg.get(key) is not None}


def _gguf_fields(get, arch: str) -> dict:
    found = {field: get(f"{arch}.{key}") for key, (field, _) in KEYS.items()}
    return {field: float(v) for field, v in found.items() if v is not None}


def _gguf_moe_fields(get, arch: str) -> dict:
    """The routed experts: softmax over all, the top-k renormalised (as transformers'
    softmax over the top-k logits); a shared expert where the file gives its width."""
    moe = MoESpec(
        n_experts=int(get(f"{arch}.expert_count")),
        top_k=int(get(f"{arch}.expert_used_count")),
        intermediate=int(get(f"{arch}.feed_forward_length")),
        scoring="softmax",
        norm_topk_prob=True,
        shared_intermediate=int(get(f"{arch}.expert_shared_feed_forward_length") or 0),
    )
    return _gguf_fields(get, arch) | {"moe": moe}


_GGUF_KEYS = {key: why for key, (_, why) in KEYS.items()}

FAMILIES = (
    Family(
        name="granite",
        hf_model_types=("granite",),
        spec_fields=_spec_fields,
        gguf_archs=("granite",),
        gguf_block=LLAMA_GGUF,
        gguf_keys=_GGUF_KEYS,
        gguf_fields=_gguf_fields,
    ),
    Family(
        name="granitemoe",
        gguf_archs=("granitemoe",),
        hf_model_types=(),
        gguf_block=MOE_GGUF,
        gguf_keys=_GGUF_KEYS
        | {"expert_shared_feed_forward_length": "the shared expert's MLP width"},
        gguf_fields=_gguf_moe_fields,
    ),
)

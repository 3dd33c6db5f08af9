"""Qwen3-MoE: Qwen3's attention (per-head Q/K norm) and routed experts without a shared
one (softmax, top-k, renormalised where norm_topk_prob says)."""

from __future__ import annotations

from tokenworks.models.arch.family import Family
from tokenworks.models.arch.llama import with_experts
from tokenworks.models.arch.qwen3 import GGUF_BLOCK as QWEN3_GGUF
from tokenworks.models.spec import MoESpec
from tokenworks.shapes import dense_layers

# llama.cpp keeps each layer's experts in one 3-D tensor per matrix ({e}: split on load)
GGUF_BLOCK = with_experts(QWEN3_GGUF)


def _fields(cfg: dict) -> dict:
    moe = MoESpec(
        n_experts=cfg.get("num_experts") or cfg["num_local_experts"],
        top_k=cfg["num_experts_per_tok"],
        intermediate=cfg["moe_intermediate_size"],
        scoring="softmax",
        norm_topk_prob=bool(cfg.get("norm_topk_prob", False)),
        dense_layers=dense_layers(cfg),
    )
    return {"moe": moe, "qk_norm": True}


def _gguf_fields(get, arch: str) -> dict:
    moe = MoESpec(
        n_experts=int(get(f"{arch}.expert_count")),
        top_k=int(get(f"{arch}.expert_used_count")),
        intermediate=int(get(f"{arch}.expert_feed_forward_length")),
        scoring="softmax",
        norm_topk_prob=bool(get(f"{arch}.expert_weights_norm", True)),
    )
    return {"moe": moe, "qk_norm": True}


FAMILY = Family(
    name="qwen3_moe",
    hf_model_types=("qwen3_moe",),
    spec_fields=_fields,
    gguf_archs=("qwen3moe",),
    gguf_block=GGUF_BLOCK,
    gguf_fields=_gguf_fields,
)

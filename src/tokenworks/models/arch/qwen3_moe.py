"""Qwen3-MoE: Qwen3's attention (per-head Q/K norm) and routed experts without a shared
one (softmax, top-k, renormalised where norm_topk_prob says)."""

from __future__ import annotations

from tokenworks.models.arch import Family
from tokenworks.models.spec import MoESpec
from tokenworks.shapes import dense_layers


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


FAMILY = Family(name="qwen3_moe", hf_model_types=("qwen3_moe",), spec_fields=_fields)

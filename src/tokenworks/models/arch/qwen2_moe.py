"""Qwen2-MoE (Qwen1.5-MoE): Qwen2's attention (QKV bias); each MoE layer has routed experts
(softmax, top-k, renormalised only where norm_topk_prob says) and one wide shared expert
whose output is scaled by sigmoid(x . g)."""

from __future__ import annotations

from tokenworks.models.arch.family import Family
from tokenworks.models.spec import MoESpec
from tokenworks.shapes import dense_layers


def _moe(cfg: dict) -> dict:
    moe = MoESpec(
        n_experts=cfg["num_experts"],
        top_k=cfg["num_experts_per_tok"],
        intermediate=cfg["moe_intermediate_size"],
        scoring="softmax",
        norm_topk_prob=bool(cfg.get("norm_topk_prob", False)),
        shared_intermediate=cfg.get("shared_expert_intermediate_size") or 0,
        shared_gate=bool(cfg.get("shared_expert_intermediate_size")),
        dense_layers=dense_layers(cfg),
    )
    return {"moe": moe}


FAMILY = Family(
    name="qwen2_moe",
    hf_model_types=("qwen2_moe",),
    spec_fields=_moe,
    hf_renames=((r"\.mlp\.shared_expert\.", ".mlp.shared_experts."),),
)

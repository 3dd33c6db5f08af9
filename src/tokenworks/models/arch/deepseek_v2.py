"""DeepSeek-V2 (and V2-Lite): V3's latent attention and shared experts with V2's router:
softmax scores, top-k greedy or group-limited greedy (a group scores by its best expert),
no renormalisation, the routed sum scaled by routed_scaling_factor. Its RoPE pairs are
always interleaved (it rotates them as complex numbers)."""

from __future__ import annotations

from tokenworks.models.arch.deepseek import deinterleave_rope, latent_spec, softmax_scale
from tokenworks.models.arch.family import Family
from tokenworks.models.spec import MoESpec
from tokenworks.shapes import dense_layers


def _fields(cfg: dict) -> dict:
    method = cfg.get("topk_method") or "greedy"
    if method not in ("greedy", "group_limited_greedy"):
        raise ValueError(
            f"DeepSeek-V2 topk_method {method!r}: expected greedy or group_limited_greedy"
        )
    grouped = method == "group_limited_greedy"
    moe = MoESpec(
        n_experts=cfg["n_routed_experts"],
        top_k=cfg["num_experts_per_tok"],
        intermediate=cfg["moe_intermediate_size"],
        scoring="softmax",
        norm_topk_prob=bool(cfg.get("norm_topk_prob", False)),
        shared_intermediate=(cfg.get("n_shared_experts") or 0) * cfg["moe_intermediate_size"],
        n_group=(cfg.get("n_group") or 1) if grouped else 1,
        topk_group=(cfg.get("topk_group") or 1) if grouped else 1,
        group_scoring="max",
        routed_scaling_factor=float(cfg.get("routed_scaling_factor", 1.0)),
        dense_layers=dense_layers(cfg),
    )
    mla = latent_spec(cfg | {"rope_interleave": True})
    head_dim = mla.qk_nope_head_dim + mla.qk_rope_head_dim
    return {"moe": moe, "mla": mla, "head_dim": head_dim, "attn_scale": softmax_scale(cfg)}


FAMILY = Family(
    name="deepseek_v2",
    hf_model_types=("deepseek_v2",),
    spec_fields=_fields,
    prepare=deinterleave_rope,
)

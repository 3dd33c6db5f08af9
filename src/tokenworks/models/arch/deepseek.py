"""DeepSeek-V3: multi-head latent attention, and MoE layers (after the first few dense ones)
with sigmoid router scores, a learned bias that steers the choice but not the weights,
group-limited top-k (only experts in the best topk_group of n_group groups compete),
shared experts, and the routed sum scaled by routed_scaling_factor."""

from __future__ import annotations

from tokenworks.models.arch.family import Family
from tokenworks.models.spec import MLASpec, MoESpec
from tokenworks.ops.rope_scaling import yarn_mscale
from tokenworks.shapes import dense_layers


def _fields(cfg: dict) -> dict:
    if cfg.get("topk_method", "noaux_tc") != "noaux_tc":
        raise ValueError(f"DeepSeek topk_method {cfg['topk_method']!r}: only noaux_tc is read")
    moe = MoESpec(
        n_experts=cfg["n_routed_experts"],
        top_k=cfg["num_experts_per_tok"],
        intermediate=cfg["moe_intermediate_size"],
        scoring=cfg.get("scoring_func", "sigmoid"),
        norm_topk_prob=bool(cfg.get("norm_topk_prob", True)),
        shared_intermediate=(cfg.get("n_shared_experts") or 0) * cfg["moe_intermediate_size"],
        score_bias=True,
        n_group=cfg.get("n_group") or 1,
        topk_group=cfg.get("topk_group") or 1,
        routed_scaling_factor=float(cfg.get("routed_scaling_factor", 1.0)),
        dense_layers=dense_layers(cfg),
    )
    mla = latent_spec(cfg)
    head_dim = mla.qk_nope_head_dim + mla.qk_rope_head_dim
    return {"moe": moe, "mla": mla, "head_dim": head_dim, "attn_scale": softmax_scale(cfg)}


def softmax_scale(cfg: dict) -> float:
    """The scale of DeepSeek's attention scores: 1/sqrt(the query head's width), and with
    YaRN (every real V2-Lite / V3 checkpoint) times mscale(factor, mscale_all_dim) squared,
    as DeepSeek's own modelling code does beside the scaled cos and sin."""
    scale = (cfg["qk_nope_head_dim"] + cfg["qk_rope_head_dim"]) ** -0.5
    rope = cfg.get("rope_scaling") or cfg.get("rope_parameters") or {}
    if rope.get("rope_type", rope.get("type")) == "yarn" and rope.get("mscale_all_dim"):
        scale *= yarn_mscale(float(rope["factor"]), rope["mscale_all_dim"]) ** 2
    return scale


def latent_spec(cfg: dict) -> MLASpec:
    """The latent attention numbers of a DeepSeek config.json (its RoPE scaling, YaRN in
    real checkpoints, is read with every family's: models/hf_dir.rope_scaling)."""
    return MLASpec(
        kv_lora_rank=cfg["kv_lora_rank"],
        qk_nope_head_dim=cfg["qk_nope_head_dim"],
        qk_rope_head_dim=cfg["qk_rope_head_dim"],
        v_head_dim=cfg["v_head_dim"],
        q_lora_rank=cfg.get("q_lora_rank"),
        rope_interleave=bool(cfg.get("rope_interleave", True)),
    )


def _deinterleave(w, start: int, n: int, period: int):
    """Rows start..start+n of every `period` rows reordered evens first, then odds."""
    import torch  # (only a checkpoint's weights need it, not its spec)

    perm = torch.cat([torch.arange(0, n, 2), torch.arange(1, n, 2)]) + start
    w = w.clone().view(-1, period, *w.shape[1:])
    w[:, start : start + n] = w[:, perm]
    return w.view(-1, *w.shape[2:])


def deinterleave_rope(weights: dict, spec) -> dict:
    """Interleaved RoPE pairs (x0, x1), (x2, x3) ... to rotate-half order: the same
    dot products, so the weights can be reordered once instead of every token."""
    mla = spec.mla
    if not mla.rope_interleave:
        return weights
    nope, rope = mla.qk_nope_head_dim, mla.qk_rope_head_dim
    out = dict(weights)
    for name, w in weights.items():
        if name.endswith(("self_attn.q_proj.weight", "self_attn.q_b_proj.weight")):
            out[name] = _deinterleave(w, nope, rope, nope + rope)
        elif name.endswith("self_attn.kv_a_proj_with_mqa.weight"):
            out[name] = _deinterleave(w, mla.kv_lora_rank, rope, mla.kv_lora_rank + rope)
    return out


FAMILY = Family(
    name="deepseek_v3",
    hf_model_types=("deepseek_v3",),
    spec_fields=_fields,
    prepare=deinterleave_rope,
)

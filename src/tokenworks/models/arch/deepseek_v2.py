"""DeepSeek-V2 (and V2-Lite): V3's latent attention and shared experts with V2's router:
softmax scores, top-k greedy or group-limited greedy (a group scores by its best expert),
no renormalisation, the routed sum scaled by routed_scaling_factor. Its RoPE pairs are
always interleaved (it rotates them as complex numbers).

llama.cpp writes V2, V2-Lite and V3 alike as `deepseek2` GGUFs, told apart by their keys
(the gating function: softmax for V2, sigmoid with a score bias for V3); those load here,
for either router."""

from __future__ import annotations

from tokenworks.models import gguf_keys
from tokenworks.models.arch.deepseek import deinterleave_rope, latent_spec, softmax_scale
from tokenworks.models.arch.family import Family
from tokenworks.models.spec import MLASpec, MoESpec
from tokenworks.ops.rope_scaling import yarn_mscale
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


SOFTMAX, SIGMOID = 1, 2  # llama.cpp's expert_gating_func values
GGUF_BLOCK = {
    "attn_norm.weight": "input_layernorm.weight",
    "ffn_norm.weight": "post_attention_layernorm.weight",
    "attn_q.weight": "self_attn.q_proj.weight",  # V2-Lite: one query projection
    "attn_q_a.weight": "self_attn.q_a_proj.weight",
    "attn_q_a_norm.weight": "self_attn.q_a_layernorm.weight",
    "attn_q_b.weight": "self_attn.q_b_proj.weight",
    "attn_kv_a_mqa.weight": "self_attn.kv_a_proj_with_mqa.weight",
    "attn_kv_a_norm.weight": "self_attn.kv_a_layernorm.weight",
    "attn_kv_b.weight": "self_attn.kv_b_proj.weight",  # older files
    "attn_k_b.weight": "self_attn.k_b_proj.weight",  # newer: kv_b split (_join_kv_b)
    "attn_v_b.weight": "self_attn.v_b_proj.weight",
    "attn_output.weight": "self_attn.o_proj.weight",
    "ffn_gate.weight": "mlp.gate_proj.weight",  # the leading dense layers
    "ffn_up.weight": "mlp.up_proj.weight",
    "ffn_down.weight": "mlp.down_proj.weight",
    "ffn_gate_inp.weight": "mlp.gate.weight",
    "exp_probs_b.bias": "mlp.gate.e_score_correction_bias",
    "ffn_gate_exps.weight": "mlp.experts.{e}.gate_proj.weight",
    "ffn_up_exps.weight": "mlp.experts.{e}.up_proj.weight",
    "ffn_down_exps.weight": "mlp.experts.{e}.down_proj.weight",
    "ffn_gate_shexp.weight": "mlp.shared_experts.gate_proj.weight",
    "ffn_up_shexp.weight": "mlp.shared_experts.up_proj.weight",
    "ffn_down_shexp.weight": "mlp.shared_experts.down_proj.weight",
}
GGUF_KEYS = {
    "leading_dense_block_count": "the leading layers with a dense MLP",
    "attention.q_lora_rank": "the query's latent width (0 or absent: one projection)",
    "attention.kv_lora_rank": "the cached latent's width",
    "attention.key_length_mla": "a query head's width, its RoPE part included",
    "attention.value_length_mla": "a value head's width",
    "expert_shared_count": "the always-on shared experts",
    "expert_weights_scale": "the routed sum's scale (routed_scaling_factor)",
    "expert_gating_func": "the router's scores: softmax (1, V2) or sigmoid (2, V3)",
    "expert_group_count": "expert groups (only the best groups' experts compete)",
    "expert_group_used_count": "the groups whose experts compete",
    "rope.scaling.yarn_log_multiplier": "YaRN's mscale_all_dim, times 0.1",
}


def _gguf_fields(get, arch: str) -> dict:
    """llama.cpp's MLA files give K and V as one head over the latent (key_length =
    kv_lora_rank + rope, head_count_kv 1) and the heads' own widths in *_mla keys; older
    files the heads' widths in key_length / value_length."""

    def key(suffix: str, default=None):
        return get(f"{arch}.{suffix}", default)

    rope = int(key("rope.dimension_count"))
    if key("attention.key_length_mla"):
        qk, v = int(key("attention.key_length_mla")), int(key("attention.value_length_mla"))
    else:
        qk, v = int(key("attention.key_length")), int(key("attention.value_length"))
    gating = int(key("expert_gating_func") or SOFTMAX)
    if gating not in (SOFTMAX, SIGMOID):
        raise ValueError(f"{arch}.expert_gating_func = {gating}: softmax (1) and sigmoid (2) run")
    experts, width = int(key("expert_count")), int(key("expert_feed_forward_length"))
    groups = int(key("expert_group_count") or 1)
    moe = MoESpec(
        n_experts=experts,
        top_k=int(key("expert_used_count")),
        intermediate=width,
        scoring="sigmoid" if gating == SIGMOID else "softmax",
        norm_topk_prob=bool(key("expert_weights_norm", False)),
        shared_intermediate=int(key("expert_shared_count") or 0) * width,
        score_bias=gating == SIGMOID,  # V3 steers its choice by a learned bias
        n_group=groups,
        topk_group=int(key("expert_group_used_count") or 1) if groups > 1 else 1,
        group_scoring="top2" if gating == SIGMOID else "max",
        routed_scaling_factor=float(key("expert_weights_scale") or 1.0),
        dense_layers=tuple(range(int(key("leading_dense_block_count") or 0))),
    )
    mla = MLASpec(
        kv_lora_rank=int(key("attention.kv_lora_rank")),
        qk_nope_head_dim=qk - rope,
        qk_rope_head_dim=rope,
        v_head_dim=v,
        q_lora_rank=int(key("attention.q_lora_rank") or 0) or None,
        rope_interleave=True,  # llama.cpp keeps the checkpoint's interleaved pairs
    )
    scale = qk**-0.5  # with YaRN, times mscale(mscale_all_dim) squared, as softmax_scale
    rs = gguf_keys.rope_scaling(get, arch, int(key("context_length")))
    if rs is not None and rs.kind == "yarn" and rs.mscale_all_dim:
        scale *= yarn_mscale(rs.factor, rs.mscale_all_dim) ** 2
    n_heads = int(key("attention.head_count"))
    return {"moe": moe, "mla": mla, "head_dim": qk, "n_kv_heads": n_heads, "attn_scale": scale}


def _join_kv_b(weights: dict, spec) -> dict:
    """A GGUF's weights as the latent attention reads them: llama.cpp's newer files split
    kv_b_proj into k_b (each head's [latent, nope], transposed) and v_b (each head's
    [v, latent]), joined back here; then the RoPE rows reordered (deinterleave_rope) on
    float copies (latent attention multiplies floats)."""
    import torch

    from tokenworks.kernels.block_linear import dense

    m, heads = spec.mla, spec.n_heads
    out = dict(weights)
    for name in [n for n in weights if n.endswith("self_attn.k_b_proj.weight")]:
        prefix = name.removesuffix("k_b_proj.weight")
        k = dense(out.pop(name)).view(heads, m.kv_lora_rank, m.qk_nope_head_dim).transpose(1, 2)
        v = dense(out.pop(prefix + "v_b_proj.weight")).view(heads, m.v_head_dim, m.kv_lora_rank)
        out[prefix + "kv_b_proj.weight"] = torch.cat([k, v], 1).reshape(-1, m.kv_lora_rank)
    rotated = ("self_attn.q_proj.weight", "self_attn.q_b_proj.weight",
               "self_attn.kv_a_proj_with_mqa.weight")  # fmt: skip
    out |= {n: dense(w) for n, w in out.items() if n.endswith(rotated)}
    return deinterleave_rope(out, spec)


FAMILY = Family(
    name="deepseek_v2",
    hf_model_types=("deepseek_v2",),
    spec_fields=_fields,
    gguf_archs=("deepseek2",),
    gguf_block=GGUF_BLOCK,
    gguf_fields=_gguf_fields,
    gguf_keys=GGUF_KEYS,
    prepare=deinterleave_rope,
    gguf_prepare=_join_kv_b,
)

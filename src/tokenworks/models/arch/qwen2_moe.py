"""Qwen2-MoE (Qwen1.5-MoE): Qwen2's attention (QKV bias); each MoE layer has routed experts
(softmax, top-k, renormalised only where norm_topk_prob says) and one wide shared expert
whose output is scaled by sigmoid(x . g)."""

from __future__ import annotations

from tokenworks.models.arch.family import Family
from tokenworks.models.arch.llama import GGUF_BLOCK as LLAMA_GGUF
from tokenworks.models.arch.llama import with_experts
from tokenworks.models.spec import MoESpec
from tokenworks.shapes import dense_layers

# llama.cpp's names: the routed experts stacked as Mixtral's, the shared one apart
GGUF_BLOCK = with_experts(LLAMA_GGUF) | {
    "ffn_gate_inp_shexp.weight": "mlp.shared_expert_gate.weight",
    "ffn_gate_shexp.weight": "mlp.shared_experts.gate_proj.weight",
    "ffn_up_shexp.weight": "mlp.shared_experts.up_proj.weight",
    "ffn_down_shexp.weight": "mlp.shared_experts.down_proj.weight",
}


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


def _gguf_moe(get, arch: str) -> dict:
    """The experts' widths as the converter writes them; top-k weights renormalised only
    where the file says so (llama.cpp's reading of qwen2moe)."""
    shared = int(get(f"{arch}.expert_shared_feed_forward_length") or 0)
    moe = MoESpec(
        n_experts=int(get(f"{arch}.expert_count")),
        top_k=int(get(f"{arch}.expert_used_count")),
        intermediate=int(get(f"{arch}.expert_feed_forward_length")),
        scoring="softmax",
        norm_topk_prob=bool(get(f"{arch}.expert_weights_norm", False)),
        shared_intermediate=shared,
        shared_gate=bool(shared),
    )
    return {"moe": moe}


FAMILY = Family(
    name="qwen2_moe",
    hf_model_types=("qwen2_moe",),
    spec_fields=_moe,
    hf_renames=((r"\.mlp\.shared_expert\.", ".mlp.shared_experts."),),
    gguf_archs=("qwen2moe",),
    gguf_block=GGUF_BLOCK,
    gguf_fields=_gguf_moe,
    gguf_keys={"expert_shared_feed_forward_length": "the shared expert's MLP width"},
)

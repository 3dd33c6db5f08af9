"""Mixtral: Mistral's attention, and an MLP of 8 experts of which each token uses 2 (softmax
over all experts, then the top 2 renormalised)."""

from __future__ import annotations

from tokenworks.models.arch.family import Family
from tokenworks.models.spec import MoESpec


def _moe(cfg: dict) -> dict:
    moe = MoESpec(
        n_experts=cfg["num_local_experts"],
        top_k=cfg["num_experts_per_tok"],
        intermediate=cfg["intermediate_size"],
        scoring="softmax",
        norm_topk_prob=True,
    )
    return {"moe": moe}


FAMILY = Family(
    name="mixtral",
    hf_model_types=("mixtral",),
    spec_fields=_moe,
    hf_renames=(
        (r"\.block_sparse_moe\.gate\.", ".mlp.gate."),
        (r"\.block_sparse_moe\.experts\.(\d+)\.w1\.", r".mlp.experts.\1.gate_proj."),
        (r"\.block_sparse_moe\.experts\.(\d+)\.w3\.", r".mlp.experts.\1.up_proj."),
        (r"\.block_sparse_moe\.experts\.(\d+)\.w2\.", r".mlp.experts.\1.down_proj."),
    ),
)

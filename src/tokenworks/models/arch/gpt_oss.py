"""gpt-oss: a mixture of experts with three departures from the others. Its attention
has biases (Q, K, V and the output) and a learned sink logit per head that joins every
softmax's denominator, on layers alternating between a 128-token window and the whole
context; its router has a bias and softmaxes only the top-k logits it chose; its experts'
products have biases and their gate is clamped (models/moe.gated). RoPE is YaRN's,
without rounding the ramp's ends to whole dimensions (`truncate` off).

Hugging Face stores each layer's experts stacked, transposed, with the gate and up
columns interleaved (gate, up, gate, up ...); llama.cpp's GGUF splits them into gate, up
and down tensors of every expert, as the engine names them."""

from __future__ import annotations

import dataclasses

from tokenworks.models import gguf_keys
from tokenworks.models.arch.family import Family
from tokenworks.models.arch.gemma import window_layers
from tokenworks.models.spec import MoESpec

RENAMES = ((r"\.mlp\.router\.", ".mlp.gate."),)
GGUF_BLOCK = (
    {
        "attn_norm.weight": "input_layernorm.weight",
        "post_attention_norm.weight": "post_attention_layernorm.weight",  # (before the MLP)
        "attn_sinks.weight": "self_attn.sinks",
        "ffn_gate_inp.weight": "mlp.gate.weight",
        "ffn_gate_inp.bias": "mlp.gate.bias",
    }
    | {
        f"attn_{g}.{kind}": f"self_attn.{e}_proj.{kind}"
        for g, e in (("q", "q"), ("k", "k"), ("v", "v"), ("output", "o"))
        for kind in ("weight", "bias")
    }
    | {
        f"ffn_{g}_exps.{kind}": f"mlp.experts.{{e}}.{g}_proj.{kind}"
        for g in ("gate", "up", "down")
        for kind in ("weight", "bias")
    }
)


def _moe(n_experts: int, top_k: int, width: int, limit: float) -> MoESpec:
    return MoESpec(
        n_experts=n_experts, top_k=top_k, intermediate=width, scoring="topk_softmax",
        norm_topk_prob=False, router_bias=True, expert_bias=True, act="swiglu_oai",
        swiglu_limit=limit,
    )  # fmt: skip


def _fields(cfg: dict) -> dict:
    moe = _moe(cfg["num_local_experts"], cfg["num_experts_per_tok"], cfg["intermediate_size"],
               float(cfg.get("swiglu_limit", 7.0)))  # fmt: skip
    return dict(
        moe=moe, qkv_bias=True, attn_out_bias=True, attn_sinks=True,
        sliding_window=cfg.get("sliding_window"),
        window_layers=window_layers(cfg.get("layer_types"), cfg["num_hidden_layers"], 2),
    )  # fmt: skip


def _gguf_fields(get, arch: str) -> dict:
    """llama.cpp's gpt-oss file: the window on alternate layers, the first windowed (as
    llama.cpp and transformers run it), its YaRN (read as every file's) without the ramp
    rounded."""

    def key(suffix: str, default=None):
        return get(f"{arch}.{suffix}", default)

    n = int(key("block_count"))
    moe = _moe(int(key("expert_count")), int(key("expert_used_count")),
               int(key("expert_feed_forward_length")), 7.0)  # fmt: skip
    out = dict(
        moe=moe, qkv_bias=True, attn_out_bias=True, attn_sinks=True,
        sliding_window=int(key("attention.sliding_window") or 128),
        window_layers=window_layers(None, n, 2), intermediate_size=moe.intermediate,
    )  # fmt: skip
    scaling = gguf_keys.rope_scaling(get, arch, int(key("context_length")))
    if scaling is not None and scaling.kind == "yarn":
        out["rope_scaling"] = dataclasses.replace(scaling, truncate=False)
    return out


def _split_experts(weights: dict, spec) -> dict:
    """Hugging Face's stacked experts, [E, h, 2I] with gate and up columns interleaved and
    [E, I, h], as each expert's gate, up and down weights [out, in] and biases."""
    out = {}
    for name, w in weights.items():
        prefix, found, tail = name.rpartition("mlp.experts.")
        if not found:
            out[name] = w
            continue
        for e in range(w.shape[0]):
            x = f"{prefix}mlp.experts.{e}."
            if tail == "gate_up_proj":
                out[x + "gate_proj.weight"] = w[e][:, 0::2].t().contiguous()
                out[x + "up_proj.weight"] = w[e][:, 1::2].t().contiguous()
            elif tail == "gate_up_proj_bias":
                out[x + "gate_proj.bias"], out[x + "up_proj.bias"] = w[e][0::2], w[e][1::2]
            elif tail == "down_proj":
                out[x + "down_proj.weight"] = w[e].t().contiguous()
            elif tail == "down_proj_bias":
                out[x + "down_proj.bias"] = w[e]
            else:
                raise ValueError(f"unexpected gpt-oss expert weight {name}")
    return out


FAMILY = Family(
    name="gpt_oss",
    hf_model_types=("gpt_oss",),
    spec_fields=_fields,
    hf_renames=RENAMES,
    gguf_archs=("gpt-oss",),
    gguf_block=GGUF_BLOCK,
    gguf_fields=_gguf_fields,
    prepare=_split_experts,
)

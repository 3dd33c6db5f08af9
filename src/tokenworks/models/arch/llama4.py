"""Llama 4's text model (Scout, Maverick) as llama.cpp's converter writes it (`llama4`):
- every fourth layer without RoPE, its queries warmed past 8,192 tokens (Llama 4's query
  temperature, spec.QueryTemperature); the RoPE layers' Q and K heads RMS-normed without a
  weight (not Maverick's, whose 128 experts llama.cpp tells it by);
- MoE layers every `interleave_moe_layer_step`, the rest dense and wider: one expert a
  token chosen by a sigmoid of its logit, which scales the expert's input rather than its
  output, beside an always-on shared expert of the experts' width;
- the RoPE layers attend within chunks of 8,192 tokens, which only a longer context tells
  from full attention: the context is held to one chunk.

Its converter keeps Hugging Face's Q and K rows, which rotate interleaved pairs as
llama.cpp's Llama RoPE does, so they are reordered as a Llama file's are."""

from __future__ import annotations

from tokenworks.models.arch.family import Family
from tokenworks.models.arch.llama import EXPERT_GGUF
from tokenworks.models.arch.llama import GGUF_BLOCK as LLAMA_GGUF
from tokenworks.models.spec import MoESpec, QueryTemperature

# llama.cpp's constants for Llama 4: no GGUF key carries them
CHUNK = 8192
NOPE_EVERY = 4
TEMPERATURE = QueryTemperature(beta=0.1, length=8192, offset=1, nope_only=True)
MAVERICK_EXPERTS = 128

GGUF_BLOCK = LLAMA_GGUF | EXPERT_GGUF | {
    "ffn_gate_shexp.weight": "mlp.shared_experts.gate_proj.weight",
    "ffn_up_shexp.weight": "mlp.shared_experts.up_proj.weight",
    "ffn_down_shexp.weight": "mlp.shared_experts.down_proj.weight",
}


def _gguf_fields(get, arch: str) -> dict:
    n = int(get(f"{arch}.block_count"))
    experts = int(get(f"{arch}.expert_count") or 0)
    out = {}
    if experts:
        step = int(get(f"{arch}.interleave_moe_layer_step") or 1)
        width = int(get(f"{arch}.expert_feed_forward_length"))
        out["moe"] = MoESpec(
            n_experts=experts, top_k=int(get(f"{arch}.expert_used_count")), intermediate=width,
            scoring="sigmoid", norm_topk_prob=False, shared_intermediate=width,
            dense_layers=tuple(i for i in range(n) if (i + 1) % step), weighted_inputs=True,
        )  # fmt: skip
    # a window of 0 (MobileLLM's files): every layer full, with RoPE, and no temperature
    if get(f"{arch}.attention.sliding_window") != 0:
        out["nope_layers"] = tuple(i for i in range(n) if (i + 1) % NOPE_EVERY == 0)
        out["query_temperature"] = TEMPERATURE
        out["max_position"] = min(int(get(f"{arch}.context_length")), CHUNK)
    out["qk_rms_norm"] = experts != MAVERICK_EXPERTS
    return out


FAMILY = Family(
    name="llama4",
    hf_model_types=(),
    gguf_archs=("llama4",),
    gguf_block=GGUF_BLOCK,
    gguf_keys={"interleave_moe_layer_step": "which layers are MoE (every step-th)"},
    gguf_fields=_gguf_fields,
)

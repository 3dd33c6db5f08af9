"""The planners' catalogue of model shapes (tokenworks/shapes.py defines ModelShape and
reads Hugging Face configs)."""

from __future__ import annotations

import json
from pathlib import Path

from tokenworks.shapes import ModelShape, from_hf_config

__all__ = ["ALIASES", "MODELS", "ModelShape", "from_hf_config", "get_model"]


def _shape(**kw) -> ModelShape:
    kw.setdefault("head_dim", kw["hidden"] // kw["n_heads"])
    return ModelShape(**kw)


MODELS: dict[str, ModelShape] = {
    m.name: m
    for m in (
        _shape(name="gpt2", n_layers=12, hidden=768, n_heads=12, n_kv_heads=12,
               intermediate=3072, vocab=50257, tie_embeddings=True, mlp="plain", norm="layer",
               bias=True, learned_positions=1024, max_context=1024,
               source="openai-community/gpt2 config.json"),
        _shape(name="smollm2-135m", n_layers=30, hidden=576, n_heads=9, n_kv_heads=3,
               intermediate=1536, vocab=49152, tie_embeddings=True, max_context=8192,
               source="HuggingFaceTB/SmolLM2-135M-Instruct config.json"),
        _shape(name="smollm2-360m", n_layers=32, hidden=960, n_heads=15, n_kv_heads=5,
               intermediate=2560, vocab=49152, tie_embeddings=True, max_context=8192,
               source="HuggingFaceTB/SmolLM2-360M-Instruct config.json"),
        _shape(name="smollm2-1.7b", n_layers=24, hidden=2048, n_heads=32, n_kv_heads=32,
               intermediate=8192, vocab=49152, tie_embeddings=True, max_context=8192,
               source="HuggingFaceTB/SmolLM2-1.7B-Instruct config.json"),
        _shape(name="llama-2-7b", n_layers=32, hidden=4096, n_heads=32, n_kv_heads=32,
               intermediate=11008, vocab=32000, max_context=4096,
               source="meta-llama/Llama-2-7b-hf config.json"),
        _shape(name="llama-2-13b", n_layers=40, hidden=5120, n_heads=40, n_kv_heads=40,
               intermediate=13824, vocab=32000, max_context=4096,
               source="meta-llama/Llama-2-13b-hf config.json"),
        _shape(name="llama-2-70b", n_layers=80, hidden=8192, n_heads=64, n_kv_heads=8,
               intermediate=28672, vocab=32000, max_context=4096,
               source="meta-llama/Llama-2-70b-hf config.json"),
        _shape(name="llama-3-8b", n_layers=32, hidden=4096, n_heads=32, n_kv_heads=8,
               intermediate=14336, vocab=128256, max_context=8192,
               source="meta-llama/Meta-Llama-3-8B config.json"),
        _shape(name="llama-3-70b", n_layers=80, hidden=8192, n_heads=64, n_kv_heads=8,
               intermediate=28672, vocab=128256, max_context=8192,
               source="meta-llama/Meta-Llama-3-70B config.json"),
        _shape(name="llama-3.1-405b", n_layers=126, hidden=16384, n_heads=128, n_kv_heads=8,
               intermediate=53248, vocab=128256, max_context=131072,
               source="meta-llama/Llama-3.1-405B config.json"),
        _shape(name="mistral-7b", n_layers=32, hidden=4096, n_heads=32, n_kv_heads=8,
               intermediate=14336, vocab=32000, sliding_window=4096, max_context=32768,
               source="mistralai/Mistral-7B-v0.1 config.json (sliding window 4096)"),
        _shape(name="mixtral-8x7b", n_layers=32, hidden=4096, n_heads=32, n_kv_heads=8,
               intermediate=14336, vocab=32000, n_experts=8, experts_per_token=2,
               moe_intermediate=14336, max_context=32768,
               source="mistralai/Mixtral-8x7B-v0.1 config.json"),
        _shape(name="qwen2.5-0.5b", n_layers=24, hidden=896, n_heads=14, n_kv_heads=2,
               intermediate=4864, vocab=151936, tie_embeddings=True, qkv_bias=True,
               max_context=32768, source="Qwen/Qwen2.5-0.5B config.json"),
        _shape(name="qwen2.5-1.5b", n_layers=28, hidden=1536, n_heads=12, n_kv_heads=2,
               intermediate=8960, vocab=151936, tie_embeddings=True, qkv_bias=True,
               max_context=32768, source="Qwen/Qwen2.5-1.5B config.json"),
        _shape(name="qwen2.5-3b", n_layers=36, hidden=2048, n_heads=16, n_kv_heads=2,
               intermediate=11008, vocab=151936, tie_embeddings=True, qkv_bias=True,
               max_context=32768, source="Qwen/Qwen2.5-3B config.json"),
        _shape(name="qwen2.5-7b", n_layers=28, hidden=3584, n_heads=28, n_kv_heads=4,
               intermediate=18944, vocab=152064, qkv_bias=True, max_context=131072,
               source="Qwen/Qwen2.5-7B config.json"),
        _shape(name="qwen2.5-14b", n_layers=48, hidden=5120, n_heads=40, n_kv_heads=8,
               intermediate=13824, vocab=152064, qkv_bias=True, max_context=131072,
               source="Qwen/Qwen2.5-14B config.json"),
        _shape(name="qwen2.5-32b", n_layers=64, hidden=5120, n_heads=40, n_kv_heads=8,
               intermediate=27648, vocab=152064, qkv_bias=True, max_context=131072,
               source="Qwen/Qwen2.5-32B config.json"),
        _shape(name="qwen2.5-72b", n_layers=80, hidden=8192, n_heads=64, n_kv_heads=8,
               intermediate=29568, vocab=152064, qkv_bias=True, max_context=131072,
               source="Qwen/Qwen2.5-72B config.json"),
        _shape(name="gemma-3-270m", n_layers=18, hidden=640, n_heads=4, n_kv_heads=1,
               head_dim=256, intermediate=2048, vocab=262144, tie_embeddings=True,
               sliding_window=512, global_every=6, max_context=32768,
               qk_norm=True, sandwich_norms=True,
               source="google/gemma-3-270m config.json (5 local : 1 global)"),
        _shape(name="gemma-3-1b", n_layers=26, hidden=1152, n_heads=4, n_kv_heads=1,
               head_dim=256, intermediate=6912, vocab=262144, tie_embeddings=True,
               sliding_window=512, global_every=6, max_context=32768,
               qk_norm=True, sandwich_norms=True,
               source="google/gemma-3-1b-it config.json (5 local : 1 global)"),
        _shape(name="gemma-3-4b", n_layers=34, hidden=2560, n_heads=8, n_kv_heads=4,
               head_dim=256, intermediate=10240, vocab=262208, tie_embeddings=True,
               sliding_window=1024, global_every=6, max_context=131072,
               qk_norm=True, sandwich_norms=True,
               source="google/gemma-3-4b-it text_config (5 local : 1 global; text only)"),
        _shape(name="gemma-3-12b", n_layers=48, hidden=3840, n_heads=16, n_kv_heads=8,
               head_dim=256, intermediate=15360, vocab=262208, tie_embeddings=True,
               sliding_window=1024, global_every=6, max_context=131072,
               qk_norm=True, sandwich_norms=True,
               source="google/gemma-3-12b-it text_config (5 local : 1 global; text only)"),
        _shape(name="gemma-3-27b", n_layers=62, hidden=5376, n_heads=32, n_kv_heads=16,
               head_dim=128, intermediate=21504, vocab=262208, tie_embeddings=True,
               sliding_window=1024, global_every=6, max_context=131072,
               qk_norm=True, sandwich_norms=True,
               source="google/gemma-3-27b-it text_config (5 local : 1 global; text only)"),
        _shape(name="qwen3-0.6b", n_layers=28, hidden=1024, n_heads=16, n_kv_heads=8,
               head_dim=128, intermediate=3072, vocab=151936, tie_embeddings=True,
               qk_norm=True, max_context=40960, source="Qwen/Qwen3-0.6B config.json"),
        _shape(name="qwen3-30b-a3b", n_layers=48, hidden=2048, n_heads=32, n_kv_heads=4,
               head_dim=128, intermediate=6144, vocab=151936, qk_norm=True, n_experts=128,
               experts_per_token=8, moe_intermediate=768, max_context=40960,
               source="Qwen/Qwen3-30B-A3B config.json"),
        _shape(name="deepseek-v3", n_layers=61, hidden=7168, n_heads=128, n_kv_heads=128,
               head_dim=128, intermediate=18432, vocab=129280, n_experts=256,
               experts_per_token=8, n_shared_experts=1, moe_intermediate=2048,
               first_dense_layers=3, router_bias=True, kv_lora_rank=512, q_lora_rank=1536,
               qk_nope_head_dim=128, qk_rope_head_dim=64, v_head_dim=128, max_context=163840,
               source="deepseek-ai/DeepSeek-V3 config.json (without the MTP module)"),
    )
}  # fmt: skip
ALIASES = {
    "llama-3.1-8b": "llama-3-8b",
    "llama-3.1-70b": "llama-3-70b",
    "smollm2": "smollm2-135m",
    "gpt-2": "gpt2",
}


def get_model(name: str) -> ModelShape:
    """A catalogue name, or a path to a Hugging Face config.json (or its directory)."""
    path = Path(name)
    if path.is_dir():
        path = path / "config.json"
    if path.suffix == ".json" and path.is_file():
        return from_hf_config(json.loads(path.read_text()), name=str(name))
    key = ALIASES.get(name.lower(), name.lower())
    if key not in MODELS:
        raise ValueError(
            f"unknown model {name!r}; known: {', '.join(MODELS)} (or a path to a config.json)"
        )
    return MODELS[key]

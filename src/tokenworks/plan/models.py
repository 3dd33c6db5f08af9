"""Model shapes: the numbers that decide parameters, FLOPs and KV memory.

A `ModelShape` holds what sizing needs and nothing a forward pass needs beyond it (no
weights, no RoPE details). Parameter counts are closed forms over the shape, norms and
biases included, so they agree with a brute-force count of an instantiated model. Any
Hugging Face `config.json` is read directly (`from_hf_config`).
"""

from __future__ import annotations

import json
from dataclasses import dataclass, replace
from pathlib import Path


@dataclass(frozen=True)
class ModelShape:
    name: str
    n_layers: int
    hidden: int
    n_heads: int
    n_kv_heads: int
    head_dim: int
    intermediate: int  # dense MLP width (the dense layers of an MoE model too)
    vocab: int
    tie_embeddings: bool = False
    mlp: str = "gated"  # gated (SwiGLU/GeGLU: 3 matrices) or plain (GPT-2: 2)
    norm: str = "rms"  # rms (weight) or layer (weight + bias)
    qkv_bias: bool = False  # Qwen2
    bias: bool = False  # every linear has a bias (GPT-2)
    learned_positions: int = 0  # GPT-2's position embedding rows
    # sliding-window attention: local layers keep `sliding_window` tokens of KV;
    # global_every = k: every k-th layer is global (Gemma 3: 6); None: all layers local
    sliding_window: int | None = None
    global_every: int | None = None
    # mixture of experts
    n_experts: int = 0  # routed experts per MoE layer (0: dense model)
    experts_per_token: int = 0
    n_shared_experts: int = 0
    moe_intermediate: int | None = None  # each expert's width
    first_dense_layers: int = 0  # DeepSeek: the first k layers are dense
    # multi-head latent attention (DeepSeek-V2/V3): K and V come from a cached latent
    kv_lora_rank: int | None = None
    q_lora_rank: int | None = None
    qk_nope_head_dim: int | None = None
    qk_rope_head_dim: int | None = None
    v_head_dim: int | None = None
    max_context: int = 4096
    source: str = ""

    def __post_init__(self) -> None:
        for f in ("n_layers", "hidden", "n_heads", "n_kv_heads", "head_dim", "vocab"):
            if getattr(self, f) < 1:
                raise ValueError(f"{self.name}: {f} must be >= 1")
        if self.n_heads % self.n_kv_heads:
            raise ValueError(
                f"{self.name}: n_heads {self.n_heads} is not a multiple of n_kv_heads "
                f"{self.n_kv_heads}"
            )
        if self.n_experts and not 0 < self.experts_per_token <= self.n_experts:
            raise ValueError(f"{self.name}: experts_per_token must be in 1..n_experts")

    # ------------------------------------------------------------------ kinds

    @property
    def attention(self) -> str:
        if self.kv_lora_rank:
            return "mla"
        if self.n_kv_heads == self.n_heads:
            return "mha"
        return "mqa" if self.n_kv_heads == 1 else "gqa"

    @property
    def is_moe(self) -> bool:
        return self.n_experts > 0

    def is_local(self, layer: int) -> bool:
        """Does this layer attend within the sliding window only?"""
        if self.sliding_window is None:
            return False
        return self.global_every is None or (layer + 1) % self.global_every != 0

    @property
    def moe_layers(self) -> int:
        return self.n_layers - self.first_dense_layers if self.is_moe else 0

    # ------------------------------------------------------------------ parameters

    def _norm(self) -> int:
        return self.hidden * (2 if self.norm == "layer" else 1)

    def attention_params(self) -> int:
        h, d = self.hidden, self.head_dim
        if self.kv_lora_rank:
            nope, rope, vd = self.qk_nope_head_dim, self.qk_rope_head_dim, self.v_head_dim
            q_head = self.n_heads * (nope + rope)
            if self.q_lora_rank:
                q = h * self.q_lora_rank + self.q_lora_rank + self.q_lora_rank * q_head
            else:
                q = h * q_head
            kv = (
                h * (self.kv_lora_rank + rope)
                + self.kv_lora_rank  # the latent's norm
                + self.kv_lora_rank * self.n_heads * (nope + vd)
            )
            return q + kv + self.n_heads * vd * h
        qkv_out = (self.n_heads + 2 * self.n_kv_heads) * d
        n = h * qkv_out + self.n_heads * d * h
        if self.qkv_bias or self.bias:
            n += qkv_out
        if self.bias:
            n += h
        return n

    def _mlp(self, width: int) -> int:
        mats = 3 if self.mlp == "gated" else 2
        n = mats * self.hidden * width
        if self.bias:
            n += width + self.hidden
        return n

    def layer_params(self, layer: int, active: bool = False) -> int:
        n = self.attention_params() + 2 * self._norm()
        if self.is_moe and layer >= self.first_dense_layers:
            experts = self.experts_per_token if active else self.n_experts
            width = self.moe_intermediate or self.intermediate
            n += (experts + self.n_shared_experts) * self._mlp(width)
            n += self.hidden * self.n_experts  # the router
        else:
            n += self._mlp(self.intermediate)
        return n

    def embedding_params(self) -> int:
        n = self.vocab * self.hidden + self.learned_positions * self.hidden
        return n if self.tie_embeddings else n + self.vocab * self.hidden

    def params(self, active: bool = False) -> int:
        """Every parameter (active=True: those one token uses in an MoE model)."""
        body = sum(self.layer_params(i, active) for i in range(self.n_layers))
        return body + self.embedding_params() + self._norm()

    def matmul_params(self, active: bool = True) -> int:
        """Parameters a token multiplies by (FLOPs per token = 2 x this): the layers and
        the LM head; embedding lookups and norms are not matmuls."""
        body = sum(self.layer_params(i, active) - 2 * self._norm() for i in range(self.n_layers))
        return body + self.vocab * self.hidden

    # ------------------------------------------------------------------ attention sizes

    def kv_elements_per_token(self, layer: int) -> int:
        """Numbers cached per token in one layer: K and V heads, or MLA's latent + RoPE key."""
        if self.kv_lora_rank:
            return self.kv_lora_rank + self.qk_rope_head_dim
        return 2 * self.n_kv_heads * self.head_dim

    def attention_flops_per_token(self, context: int) -> float:
        """QK^T and PV for one new token over `context` keys, summed over layers."""
        d_qk = (
            (self.qk_nope_head_dim + self.qk_rope_head_dim) if self.kv_lora_rank else self.head_dim
        )
        d_v = self.v_head_dim if self.kv_lora_rank else self.head_dim
        total = 0.0
        for i in range(self.n_layers):
            keys = min(context, self.sliding_window) if self.is_local(i) else context
            total += 2 * self.n_heads * (d_qk + d_v) * keys
        return total


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
        _shape(name="gemma-3-1b", n_layers=26, hidden=1152, n_heads=4, n_kv_heads=1,
               head_dim=256, intermediate=6912, vocab=262144, tie_embeddings=True,
               sliding_window=512, global_every=6, max_context=32768,
               source="google/gemma-3-1b-it config.json (5 local : 1 global)"),
        _shape(name="gemma-3-4b", n_layers=34, hidden=2560, n_heads=8, n_kv_heads=4,
               head_dim=256, intermediate=10240, vocab=262208, tie_embeddings=True,
               sliding_window=1024, global_every=6, max_context=131072,
               source="google/gemma-3-4b-it text_config (5 local : 1 global; text only)"),
        _shape(name="gemma-3-12b", n_layers=48, hidden=3840, n_heads=16, n_kv_heads=8,
               head_dim=256, intermediate=15360, vocab=262208, tie_embeddings=True,
               sliding_window=1024, global_every=6, max_context=131072,
               source="google/gemma-3-12b-it text_config (5 local : 1 global; text only)"),
        _shape(name="gemma-3-27b", n_layers=62, hidden=5376, n_heads=32, n_kv_heads=16,
               head_dim=128, intermediate=21504, vocab=262208, tie_embeddings=True,
               sliding_window=1024, global_every=6, max_context=131072,
               source="google/gemma-3-27b-it text_config (5 local : 1 global; text only)"),
        _shape(name="deepseek-v3", n_layers=61, hidden=7168, n_heads=128, n_kv_heads=128,
               head_dim=128, intermediate=18432, vocab=129280, n_experts=256,
               experts_per_token=8, n_shared_experts=1, moe_intermediate=2048,
               first_dense_layers=3, kv_lora_rank=512, q_lora_rank=1536,
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


def from_hf_config(cfg: dict, name: str = "") -> ModelShape:
    """A ModelShape from a Hugging Face config dict (Llama, Mistral, Qwen2, Mixtral, Gemma 3,
    DeepSeek-V2/V3, GPT-2 families)."""
    if "text_config" in cfg:  # multimodal wrappers (Gemma 3): the language model's config
        cfg = {**cfg["text_config"], "_outer": cfg.get("model_type")}
    try:
        if cfg.get("model_type") == "gpt2" or "n_embd" in cfg:
            h = cfg["n_embd"]
            return ModelShape(
                name=name or "gpt2-like",
                n_layers=cfg["n_layer"],
                hidden=h,
                n_heads=cfg["n_head"],
                n_kv_heads=cfg["n_head"],
                head_dim=h // cfg["n_head"],
                intermediate=cfg.get("n_inner") or 4 * h,
                vocab=cfg["vocab_size"],
                tie_embeddings=True,
                mlp="plain",
                norm="layer",
                bias=True,
                learned_positions=cfg.get("n_positions", 1024),
                max_context=cfg.get("n_positions", 1024),
                source="config.json",
            )
        heads = cfg["num_attention_heads"]
        hidden = cfg["hidden_size"]
        layer_types = cfg.get("layer_types")
        global_every = None
        window = cfg.get("sliding_window")
        if cfg.get("use_sliding_window") is False:
            window = None
        if window and cfg.get("sliding_window_pattern"):
            global_every = cfg["sliding_window_pattern"]
        elif window and layer_types:
            full = [i for i, t in enumerate(layer_types) if t == "full_attention"]
            global_every = (full[0] + 1) if full else None
        experts = cfg.get("num_local_experts") or cfg.get("n_routed_experts") or 0
        shape = ModelShape(
            name=name or cfg.get("model_type", "model"),
            n_layers=cfg["num_hidden_layers"],
            hidden=hidden,
            n_heads=heads,
            n_kv_heads=cfg.get("num_key_value_heads") or heads,
            head_dim=cfg.get("head_dim") or hidden // heads,
            intermediate=cfg["intermediate_size"],
            vocab=cfg["vocab_size"],
            tie_embeddings=bool(cfg.get("tie_word_embeddings", False)),
            qkv_bias=bool(cfg.get("attention_bias", False)) or cfg.get("model_type") == "qwen2",
            sliding_window=window,
            global_every=global_every,
            n_experts=experts,
            experts_per_token=cfg.get("num_experts_per_tok", 0) if experts else 0,
            n_shared_experts=cfg.get("n_shared_experts") or 0,
            moe_intermediate=cfg.get("moe_intermediate_size"),
            first_dense_layers=cfg.get("first_k_dense_replace", 0) if experts else 0,
            kv_lora_rank=cfg.get("kv_lora_rank"),
            q_lora_rank=cfg.get("q_lora_rank"),
            qk_nope_head_dim=cfg.get("qk_nope_head_dim"),
            qk_rope_head_dim=cfg.get("qk_rope_head_dim"),
            v_head_dim=cfg.get("v_head_dim"),
            max_context=cfg.get("max_position_embeddings", 4096),
            source="config.json",
        )
    except KeyError as e:
        raise ValueError(f"config.json lacks {e.args[0]!r}: is it a decoder-only LM?") from e
    if shape.kv_lora_rank:  # MLA: K/V heads are reconstructed per query head
        shape = replace(shape, n_kv_heads=heads)
    return shape

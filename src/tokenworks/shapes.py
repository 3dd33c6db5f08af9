"""Model shapes, read from Hugging Face configs, and the KV memory they need (torch-free).

A `ModelShape` holds the numbers that decide parameters, FLOPs and KV memory, and nothing
a forward pass needs beyond them (no weights, no RoPE details). Parameter counts are
closed forms over the shape, norms and biases included, so they agree with a brute-force
count of an instantiated model. `from_hf_config` reads any Hugging Face `config.json`;
models/ reads its architectures' configs through it, and plan/ sizes everything with it.

KV bytes: per token and layer a cache holds K and V for each KV head (MHA: every head;
GQA: a group's shared head; MQA: one), or for multi-head latent attention the compressed
latent plus the decoupled RoPE key (DeepSeek caches kv_lora_rank + qk_rope_head_dim
numbers). A sliding-window layer never holds more than its window.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

from tokenworks.units import dtype_bytes


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
    qk_norm: bool = False  # Qwen3, Gemma 3: an RMSNorm weight over each head of Q and of K
    qk_norm_whole: bool = False  # OLMo 2: the Q and K norms span all heads (q + kv weights)
    sandwich_norms: bool = False  # Gemma 2/3: four norms a layer (after attention and MLP too)
    pre_norms: bool = True  # False (OLMo 2): no norms before the sublayers, only after
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
    shared_intermediate: int = 0  # the shared experts' total width (0: n_shared x expert's)
    shared_expert_gate: bool = False  # Qwen2-MoE: a 1-output gate on the shared expert
    router_bias: bool = False  # DeepSeek-V3, gpt-oss: a bias per expert on the router's scores
    expert_bias: bool = False  # gpt-oss: biases on each expert's products
    attn_out_bias: bool = False  # gpt-oss: a bias on the attention's output projection
    attn_sinks: bool = False  # gpt-oss: a learned logit per head
    first_dense_layers: int = 0  # layers with a dense MLP (DeepSeek: the first k)
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
        if self.bias or self.attn_out_bias:
            n += h
        return n + self._qk_norms() + self.n_heads * self.attn_sinks

    def _qk_norms(self) -> int:
        if self.qk_norm_whole:
            return (self.n_heads + self.n_kv_heads) * self.head_dim
        return 2 * self.head_dim if self.qk_norm else 0

    def _mlp(self, width: int) -> int:
        mats = 3 if self.mlp == "gated" else 2
        n = mats * self.hidden * width
        if self.bias:
            n += width + self.hidden
        return n

    def _layer_norms(self) -> int:
        return (2 * self.pre_norms + 2 * self.sandwich_norms) * self._norm()

    def layer_params(self, layer: int, active: bool = False) -> int:
        return self.attention_params() + self._layer_norms() + self.mlp_params(layer, active)

    def mlp_params(self, layer: int, active: bool = False) -> int:
        """A layer's MLP: dense, or its router and experts (active: the k a token uses)."""
        n = 0
        if self.is_moe and layer >= self.first_dense_layers:
            experts = self.experts_per_token if active else self.n_experts
            width = self.moe_intermediate or self.intermediate
            n += experts * (self._mlp(width) + (2 * width + self.hidden) * self.expert_bias)
            if self.shared_intermediate:
                n += self._mlp(self.shared_intermediate)
            else:
                n += self.n_shared_experts * self._mlp(width)
            n += self.hidden * self.n_experts  # the router
            n += self.hidden * self.shared_expert_gate + self.n_experts * self.router_bias
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
        the LM head; embedding lookups and norms (Qwen3's per-head Q/K norms too) are not
        matmuls."""
        norms = self._layer_norms() + self._qk_norms()
        body = sum(self.layer_params(i, active) - norms for i in range(self.n_layers))
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
        experts = (
            cfg.get("num_local_experts") or cfg.get("n_routed_experts") or cfg.get("num_experts")
        ) or 0
        mtype = cfg.get("model_type", "")
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
            qkv_bias=bool(cfg.get("attention_bias", False) or cfg.get("qkv_bias", False))
            or mtype == "qwen2",
            qk_norm=mtype.startswith(("qwen3", "gemma3", "olmo2")),
            qk_norm_whole=mtype == "olmo2",
            sandwich_norms=mtype.startswith(("gemma2", "gemma3", "olmo2")),
            pre_norms=mtype != "olmo2",
            sliding_window=window,
            global_every=global_every,
            n_experts=experts,
            experts_per_token=cfg.get("num_experts_per_tok", 0) if experts else 0,
            n_shared_experts=cfg.get("n_shared_experts") or 0,
            moe_intermediate=cfg.get("moe_intermediate_size"),
            shared_intermediate=cfg.get("shared_expert_intermediate_size") or 0,
            shared_expert_gate=bool(cfg.get("shared_expert_intermediate_size")),
            router_bias=mtype in ("deepseek_v3", "gpt_oss"),
            expert_bias=mtype == "gpt_oss",
            attn_out_bias=mtype == "gpt_oss" and bool(cfg.get("attention_bias")),
            attn_sinks=mtype == "gpt_oss",
            first_dense_layers=len(dense_layers(cfg)) if experts else 0,
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


def dense_layers(cfg: dict) -> tuple[int, ...]:
    """The layers of an MoE config whose MLP is dense: DeepSeek's first_k_dense_replace,
    Qwen-MoE's mlp_only_layers and those off its decoder_sparse_step."""
    n = cfg["num_hidden_layers"]
    step = cfg.get("decoder_sparse_step") or 1
    only = set(cfg.get("mlp_only_layers") or ())
    first = cfg.get("first_k_dense_replace") or 0
    return tuple(i for i in range(n) if i < first or i in only or (i + 1) % step)


def kv_bytes_per_token(
    model: ModelShape, kv_dtype: str = "bf16", layers: int | None = None
) -> float:
    """Bytes one token of context adds to the cache (window not reached), over all layers
    or the first `layers` (a pipeline stage's share)."""
    b = dtype_bytes(kv_dtype)
    return sum(model.kv_elements_per_token(i) for i in range(layers or model.n_layers)) * b


def first_block_read(window: int | None, position: int, block_size: int) -> int:
    """The first block of a paged cache a query at `position` reads in a layer with this
    window (None: it reads all, from block 0)."""
    return 0 if window is None else max(0, position - window + 1) // block_size


def window_blocks(context: int, window: int, block_size: int) -> int:
    """Blocks a windowed layer of a paged cache holds at `context` cached tokens: those the
    next token's window reads (the ones wholly behind it are given back)."""
    return -(-context // block_size) - first_block_read(window, context, block_size)


def kv_bytes(
    model: ModelShape,
    context: int,
    kv_dtype: str = "bf16",
    layers: int | None = None,
    block_size: int | None = None,
) -> float:
    """Bytes one sequence's cache holds at `context` tokens (sliding windows capped), over
    all layers or the first `layers`. With a block_size, in whole blocks of a paged cache
    whose windowed layers give back the blocks behind their window (engine/kv_groups.py)."""
    if context < 0:
        raise ValueError("context must be >= 0 tokens")
    b = dtype_bytes(kv_dtype)
    total = 0.0
    for i in range(layers or model.n_layers):
        if block_size is None:
            tokens = min(context, model.sliding_window) if model.is_local(i) else context
        elif model.is_local(i):
            tokens = window_blocks(context, model.sliding_window, block_size) * block_size
        else:
            tokens = -(-context // block_size) * block_size
        total += tokens * model.kv_elements_per_token(i) * b
    return total

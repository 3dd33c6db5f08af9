"""ModelSpec: the architecture numbers a forward pass needs, whatever file they came from."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field

from tokenworks.shapes import ModelShape


@dataclass(frozen=True)
class RopeScaling:
    """RoPE scaled for contexts longer than training's (ops/rope.py computes each):
    - llama3: Llama 3.1's frequency-dependent interpolation;
    - linear: every frequency divided by factor (position interpolation);
    - dynamic: NTK-aware, a larger base, fixed for the longest context it allows
      (factor x the trained length, as vLLM computes it, so cached keys stay valid);
    - yarn: interpolate the low frequencies, keep the high ones, ramp between, and scale
      cos and sin by attention_factor (arXiv 2309.00071)."""

    factor: float
    low_freq_factor: float = 1.0  # llama3
    high_freq_factor: float = 4.0  # llama3
    original_max_position: int = 8192  # llama3, yarn; dynamic: the trained context
    kind: str = "llama3"
    beta_fast: float = 32.0  # yarn
    beta_slow: float = 1.0
    attention_factor: float | None = None  # yarn; None: 0.1 ln(factor) + 1 (or mscales)
    mscale: float | None = None
    mscale_all_dim: float | None = None
    truncate: bool = True

    def __post_init__(self) -> None:
        if self.kind not in ("llama3", "linear", "dynamic", "yarn"):
            raise ValueError(f"rope scaling {self.kind!r}: expected llama3, linear, dynamic, yarn")
        if self.factor <= 0:
            raise ValueError(f"rope scaling factor {self.factor} must be > 0")

    @property
    def context(self) -> int:
        """The longest context the scaling is made for."""
        return int(self.original_max_position * self.factor)

    @property
    def extends_context(self) -> bool:
        """Whether the model's context is `context` rather than its config's
        max_position_embeddings: dynamic and YaRN configs give the trained length there,
        linear ones the interpolated length already, Llama 3's its own."""
        return self.kind in ("dynamic", "yarn")


@dataclass(frozen=True)
class MoESpec:
    """A mixture-of-experts MLP: a router scores the experts for each token, the top_k run
    and their outputs are summed, weighted by the scores (models/moe.py)."""

    n_experts: int
    top_k: int
    intermediate: int  # each expert's width
    # softmax over all experts (Mixtral, Qwen), sigmoid (DeepSeek-V3), or a softmax over
    # the top_k chosen logits alone (gpt-oss: "topk_softmax")
    scoring: str = "softmax"
    norm_topk_prob: bool = True  # renormalise the chosen scores to sum to 1
    shared_intermediate: int = 0  # width of the always-on shared expert(s); 0: none
    shared_gate: bool = False  # Qwen2-MoE: the shared expert's output times sigmoid(x . g)
    score_bias: bool = False  # DeepSeek-V3: a learned bias added to scores to choose, not weigh
    n_group: int = 1  # DeepSeek: experts in n_group groups; choose within the best topk_group
    topk_group: int = 1
    group_scoring: str = "top2"  # a group's score: its best two summed (V3) or its best (V2)
    routed_scaling_factor: float = 1.0
    dense_layers: tuple[int, ...] = ()  # layers whose MLP is a plain dense one
    router_bias: bool = False  # gpt-oss: the router's logits have a bias
    expert_bias: bool = False  # gpt-oss: each expert's products have biases
    # the experts' activation: "silu" (SwiGLU) or "swiglu_oai" (gpt-oss: the gate clamped
    # above at swiglu_limit, the up part to +-swiglu_limit, gate * sigmoid(alpha gate) *
    # (up + 1))
    act: str = "silu"
    swiglu_limit: float = 7.0
    swiglu_alpha: float = 1.702
    # Llama 4: each expert reads its input times its routing weight, and its output is
    # added as it is (with one expert a token, the weight then passes through SwiGLU)
    weighted_inputs: bool = False
    # expert parallelism: the routed experts this rank holds, [first, last) (None: all)
    local_experts: tuple[int, int] | None = None

    def __post_init__(self) -> None:
        if not 0 < self.top_k <= self.n_experts:
            raise ValueError(f"top_k {self.top_k} must be in 1..n_experts ({self.n_experts})")
        if self.scoring not in ("softmax", "sigmoid", "topk_softmax"):
            raise ValueError(
                f"router scoring {self.scoring!r}: expected softmax, sigmoid or topk_softmax"
            )
        if self.act not in ("silu", "swiglu_oai"):
            raise ValueError(f"expert activation {self.act!r}: expected silu or swiglu_oai")
        if self.group_scoring not in ("top2", "max"):
            raise ValueError(f"group scoring {self.group_scoring!r}: expected top2 or max")
        if self.n_experts % self.n_group or not 0 < self.topk_group <= self.n_group:
            raise ValueError(
                f"{self.n_experts} experts in {self.n_group} groups, best {self.topk_group}: "
                "the groups must divide the experts and topk_group be in 1..n_group"
            )


@dataclass(frozen=True)
class QueryTemperature:
    """Queries sharpened with distance into a long context (Ministral 3, Llama 4): after RoPE,
    each query times 1 + beta ln(1 + floor((position + offset) / length)), which is 1 for the
    first `length` positions."""

    beta: float
    length: int
    offset: int = 0
    nope_only: bool = False  # Llama 4: only the layers without RoPE

    def factors(self, positions):  # a tensor or array of positions -> their factors
        floor = ((positions + self.offset) // self.length).double()
        return 1 + self.beta * (1 + floor).log()


@dataclass(frozen=True)
class MLASpec:
    """Multi-head latent attention (DeepSeek-V2/V3): keys and values come from a cached
    latent of kv_lora_rank numbers plus one RoPE key of qk_rope_head_dim shared by all
    heads (models/mla.py)."""

    kv_lora_rank: int
    qk_nope_head_dim: int
    qk_rope_head_dim: int
    v_head_dim: int
    q_lora_rank: int | None = None  # None: the query is one projection, not two
    # the file stores each RoPE part as interleaved pairs; the loader reorders those rows
    # so the engine's rotate-half RoPE applies (models/arch/deepseek.py)
    rope_interleave: bool = False


@dataclass(frozen=True)
class ModelSpec:
    arch: str  # a family of models/arch (llama, qwen3, mixtral, deepseek_v3, gpt2, ...)
    vocab_size: int
    hidden_size: int
    n_layers: int
    n_heads: int
    n_kv_heads: int
    head_dim: int
    intermediate_size: int
    max_position: int
    norm_eps: float
    rope_theta: float = 10000.0
    rope_scaling: RopeScaling | None = None
    tie_embeddings: bool = False
    qkv_bias: bool = False  # Qwen2
    qk_norm: bool = False  # Qwen3, Gemma 3: RMSNorm over each head of Q and K before RoPE
    qk_rms_norm: bool = False  # Llama 4: the same without a weight, on the layers with RoPE
    sliding_window: int | None = None  # Mistral: attend to at most this many past tokens
    window_layers: tuple[int, ...] | None = None  # the layers with the window (None: all)
    rope_local_theta: float | None = None  # Gemma 3: the RoPE base of the windowed layers
    nope_layers: tuple[int, ...] = ()  # SmolLM3: layers whose Q and K get no RoPE
    # Gemma 2/3: norms after attention and after the MLP too, a GeGLU MLP, embeddings
    # times sqrt(hidden), queries scaled by query_pre_attn_scalar**-0.5, soft-capped scores
    sandwich_norms: bool = False
    mlp_act: str = "silu"  # silu (SwiGLU) or gelu_tanh (GeGLU)
    # the embedding rows times this, rounded to the model's dtype first (Gemma: sqrt(hidden),
    # Granite: its embedding_multiplier); None: as stored
    embed_scale: float | None = None
    residual_scale: float | None = None  # Granite: each sublayer's output times this as it joins
    logit_scale: float | None = None  # Granite: the logits divided by this
    query_temperature: QueryTemperature | None = None
    # OLMo 2: no norm before either sublayer (its norms are the sandwich's output norms)
    # and Q/K norms over all heads at once rather than each head
    pre_norms: bool = True
    qk_norm_whole: bool = False
    attn_scale: float | None = None  # None: head_dim**-0.5
    attn_softcap: float | None = None  # scores -> cap * tanh(scores / cap)
    attn_sinks: bool = False  # gpt-oss: a learned logit per head in every softmax's denominator
    attn_out_bias: bool = False  # gpt-oss: the attention's output projection has a bias
    final_softcap: float | None = None  # logits -> cap * tanh(logits / cap)
    moe: MoESpec | None = None
    mla: MLASpec | None = None
    bos_token_id: int | None = None
    eos_token_ids: tuple[int, ...] = ()
    name: str = ""
    source: str = ""  # where the numbers were read from
    extra: dict = field(default_factory=dict, compare=False, hash=False)

    def __post_init__(self) -> None:
        if self.n_heads % self.n_kv_heads:
            raise ValueError(f"n_heads={self.n_heads} is not a multiple of n_kv={self.n_kv_heads}")
        if self.sliding_window is not None and self.sliding_window < 1:
            raise ValueError(
                f"a sliding window of {self.sliding_window} tokens attends to nothing (a model "
                "without a window has none)"
            )

    @property
    def q_size(self) -> int:
        return self.n_heads * self.head_dim

    @property
    def kv_size(self) -> int:
        return self.n_kv_heads * self.head_dim

    @property
    def rope_dim(self) -> int:
        """Dimensions RoPE rotates: the whole head, or MLA's decoupled RoPE part."""
        return self.mla.qk_rope_head_dim if self.mla else self.head_dim

    @property
    def kv_layout(self) -> tuple[int, int, int]:
        """What the cache holds per token and layer: (heads, K width, V width). MLA keeps
        one latent row (the compressed KV, then the RoPE key) and no separate V."""
        if self.mla:
            return 1, self.mla.kv_lora_rank + self.mla.qk_rope_head_dim, 0
        return self.n_kv_heads, self.head_dim, self.head_dim

    def window(self, layer: int) -> int | None:
        """The sliding window of this layer, or None where it attends to everything."""
        if self.sliding_window is None:
            return None
        if self.window_layers is None or layer in self.window_layers:
            return self.sliding_window
        return None

    @property
    def local_rope(self) -> ModelSpec | None:
        """This spec as the windowed layers' RoPE sees it (Gemma 3: their own base and no
        scaling), or None where every layer rotates alike."""
        if self.rope_local_theta is None:
            return None
        return dataclasses.replace(self, rope_theta=self.rope_local_theta, rope_scaling=None)

    @property
    def global_every(self) -> int | None:
        """k where every k-th layer is global and the rest windowed (ModelShape's form)."""
        if self.window_layers is None or self.sliding_window is None:
            return None
        full = [i for i in range(self.n_layers) if i not in self.window_layers]
        return full[0] + 1 if full else None

    def is_moe_layer(self, layer: int) -> bool:
        return self.moe is not None and layer not in self.moe.dense_layers

    @property
    def shape(self) -> ModelShape:
        """The sizing numbers of this model (parameters, FLOPs, KV bytes: shapes.py)."""
        gpt2 = self.arch == "gpt2"
        moe, mla = self.moe, self.mla
        experts = {}
        if moe:
            experts = dict(
                n_experts=moe.n_experts, experts_per_token=moe.top_k,
                moe_intermediate=moe.intermediate, first_dense_layers=len(moe.dense_layers),
                shared_intermediate=moe.shared_intermediate, shared_expert_gate=moe.shared_gate,
                router_bias=moe.score_bias or moe.router_bias, expert_bias=moe.expert_bias,
            )  # fmt: skip
        latent = {}
        if mla:
            latent = dict(
                kv_lora_rank=mla.kv_lora_rank, q_lora_rank=mla.q_lora_rank,
                qk_nope_head_dim=mla.qk_nope_head_dim, qk_rope_head_dim=mla.qk_rope_head_dim,
                v_head_dim=mla.v_head_dim,
            )  # fmt: skip
        return ModelShape(
            name=self.name or self.arch, n_layers=self.n_layers, hidden=self.hidden_size,
            n_heads=self.n_heads, n_kv_heads=self.n_kv_heads, head_dim=self.head_dim,
            intermediate=self.intermediate_size, vocab=self.vocab_size,
            tie_embeddings=self.tie_embeddings, mlp="plain" if gpt2 else "gated",
            norm="layer" if gpt2 else "rms", qkv_bias=self.qkv_bias, bias=gpt2,
            qk_norm=self.qk_norm, qk_norm_whole=self.qk_norm_whole,
            sandwich_norms=self.sandwich_norms, pre_norms=self.pre_norms,
            attn_out_bias=self.attn_out_bias, attn_sinks=self.attn_sinks,
            learned_positions=self.max_position if gpt2 else 0,
            sliding_window=self.sliding_window, global_every=self.global_every,
            max_context=self.max_position,
            source=self.source, **experts, **latent,
        )  # fmt: skip

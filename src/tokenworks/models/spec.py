"""ModelSpec: the architecture numbers a forward pass needs, whatever file they came from."""

from __future__ import annotations

from dataclasses import dataclass, field

from tokenworks.shapes import ModelShape


@dataclass(frozen=True)
class RopeScaling:
    """Llama 3-style frequency-dependent RoPE scaling (rope_type "llama3")."""

    factor: float
    low_freq_factor: float
    high_freq_factor: float
    original_max_position: int


@dataclass(frozen=True)
class ModelSpec:
    arch: str  # "llama" (Llama 2/3, SmolLM2, Mistral, Qwen2) or "gpt2"
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
    sliding_window: int | None = None  # Mistral: attend to at most this many past tokens
    bos_token_id: int | None = None
    eos_token_ids: tuple[int, ...] = ()
    name: str = ""
    source: str = ""  # where the numbers were read from
    extra: dict = field(default_factory=dict, compare=False, hash=False)

    def __post_init__(self) -> None:
        if self.arch not in ("llama", "gpt2"):
            raise ValueError(f"unsupported architecture {self.arch!r}: expected llama or gpt2")
        if self.n_heads % self.n_kv_heads:
            raise ValueError(f"n_heads={self.n_heads} is not a multiple of n_kv={self.n_kv_heads}")

    @property
    def q_size(self) -> int:
        return self.n_heads * self.head_dim

    @property
    def kv_size(self) -> int:
        return self.n_kv_heads * self.head_dim

    @property
    def shape(self) -> ModelShape:
        """The sizing numbers of this model (parameters, FLOPs, KV bytes: shapes.py)."""
        gpt2 = self.arch == "gpt2"
        return ModelShape(
            name=self.name or self.arch, n_layers=self.n_layers, hidden=self.hidden_size,
            n_heads=self.n_heads, n_kv_heads=self.n_kv_heads, head_dim=self.head_dim,
            intermediate=self.intermediate_size, vocab=self.vocab_size,
            tie_embeddings=self.tie_embeddings, mlp="plain" if gpt2 else "gated",
            norm="layer" if gpt2 else "rms", qkv_bias=self.qkv_bias, bias=gpt2,
            learned_positions=self.max_position if gpt2 else 0,
            sliding_window=self.sliding_window, max_context=self.max_position,
            source=self.source,
        )  # fmt: skip

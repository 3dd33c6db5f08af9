"""Does it fit: weights, KV cache and headroom per device, split by tensor and pipeline
parallelism, and how many sequences fit at a context.

Tensor parallel (tp) shards every matrix over tp devices: attention heads must divide by
tp, and KV heads either divide by tp or are replicated (tp a multiple of the KV heads, as
vLLM does; MLA's latent is replicated on every rank). Pipeline parallel (pp) gives each
stage a contiguous run of layers; the fullest stage (ceil(layers / pp) layers plus the
larger of the embedding and the LM head) decides.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass

from tokenworks.plan.hardware import Hardware
from tokenworks.plan.kv import kv_bytes, kv_bytes_per_token
from tokenworks.plan.models import ModelShape
from tokenworks.plan.quant import QuantScheme
from tokenworks.units import GiB


@dataclass
class Fit:
    model: str
    hardware: str
    tp: int
    pp: int
    devices: int
    context: int
    batch: int
    weight_format: str
    kv_dtype: str
    device_memory: float
    usable: float  # memory * utilisation - overhead
    weights_per_device: float
    kv_per_token_per_device: float
    kv_per_sequence_per_device: float
    kv_budget_per_device: float
    max_sequences: int  # at this context
    fits: bool
    verdict: str
    adapters_per_device: float = 0.0  # LoRA adapters held beside the weights

    def to_dict(self) -> dict:
        return asdict(self)


def lora_bytes(model: ModelShape, rank: int, element_bytes: int = 2) -> int:
    """One LoRA adapter of this rank on every attention and MLP product (q, k, v, o, gate,
    up, down), A and B, in elements of this size."""
    q, kv = model.n_heads * model.head_dim, model.n_kv_heads * model.head_dim
    h, i = model.hidden, model.intermediate
    per_layer = (h + q) + 2 * (h + kv) + (q + h) + 2 * (h + i) + (i + h)
    return model.n_layers * rank * per_layer * element_bytes


def check_parallel(model: ModelShape, tp: int, pp: int) -> None:
    if tp < 1 or pp < 1:
        raise ValueError("tp and pp must be >= 1")
    if model.n_heads % tp:
        raise ValueError(
            f"tp={tp} does not divide {model.name}'s {model.n_heads} attention heads; "
            f"choose a divisor of {model.n_heads}"
        )
    kv = model.n_kv_heads
    if model.attention != "mla" and kv % tp and tp % kv:
        raise ValueError(
            f"tp={tp} neither divides nor is a multiple of {model.name}'s {kv} KV heads"
        )
    if pp > model.n_layers:
        raise ValueError(f"pp={pp} is more stages than {model.name}'s {model.n_layers} layers")


def kv_heads_share(model: ModelShape, tp: int) -> float:
    """Fraction of each layer's per-token KV that one tensor-parallel rank holds."""
    if model.attention == "mla":
        return 1.0  # the latent is replicated on every rank
    per_rank = max(1, model.n_kv_heads // tp)
    return per_rank / model.n_kv_heads


def weights_per_device(model: ModelShape, scheme: QuantScheme, tp: int, pp: int) -> float:
    bpw = scheme.bits_per_weight / 8
    layers = math.ceil(model.n_layers / pp)
    per_layer = max(model.layer_params(i) for i in range(model.n_layers))
    embed = model.vocab * model.hidden + model.learned_positions * model.hidden
    ends = embed if (model.tie_embeddings or pp > 1) else 2 * embed  # first/last stage
    return (layers * per_layer + ends) * bpw / tp


def fit(
    model: ModelShape,
    hw: Hardware,
    *,
    tp: int = 1,
    pp: int = 1,
    context: int | None = None,
    batch: int = 1,
    scheme: QuantScheme,
    kv_dtype: str = "bf16",
    utilization: float = 0.9,
    overhead: float = 1 * GiB,
    adapters: int = 0,
    adapter_rank: int = 16,
) -> Fit:
    """adapters: LoRA adapters of adapter_rank held at once (--max-loras), split over the
    devices as the weights are."""
    check_parallel(model, tp, pp)
    context = context or model.max_context
    if context < 1 or batch < 1:
        raise ValueError("context and batch must be >= 1")
    if not 0 < utilization <= 1:
        raise ValueError("utilization must be in (0, 1]")
    share = kv_heads_share(model, tp)
    layers = math.ceil(model.n_layers / pp)  # the fullest stage
    kv_token_dev = kv_bytes_per_token(model, kv_dtype, layers) * share
    kv_seq_dev = kv_bytes(model, context, kv_dtype, layers) * share  # windows capped
    weights = weights_per_device(model, scheme, tp, pp)
    held = adapters * lora_bytes(model, adapter_rank) / (tp * pp)
    usable = hw.memory_bytes * utilization - overhead
    budget = usable - weights - held
    max_seqs = max(0, int(budget // kv_seq_dev)) if kv_seq_dev else 0
    if budget <= 0:
        fits, verdict = False, "the weights alone do not fit"
    elif max_seqs < batch:
        fits = False
        verdict = f"weights fit, but only {max_seqs} sequence(s) of {context} tokens fit"
    else:
        fits, verdict = True, f"fits: up to {max_seqs} sequences of {context} tokens"
    return Fit(
        model=model.name,
        hardware=hw.name,
        tp=tp,
        pp=pp,
        devices=tp * pp,
        context=context,
        batch=batch,
        weight_format=scheme.name,
        kv_dtype=kv_dtype,
        device_memory=hw.memory_bytes,
        usable=usable,
        weights_per_device=weights,
        kv_per_token_per_device=kv_token_dev,
        kv_per_sequence_per_device=kv_seq_dev,
        kv_budget_per_device=budget,
        max_sequences=max_seqs,
        fits=fits,
        verdict=verdict,
        adapters_per_device=held,
    )

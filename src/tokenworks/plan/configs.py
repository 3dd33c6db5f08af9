"""Each `tokenworks plan` command's options, a dataclass apiece: their fields make its flags
(tokenworks/options.py), as the engine's and the benchmarks' are, and the command gets
the dataclass. The options several commands share are bases written once; a field without
a default is a required flag."""

from __future__ import annotations

from dataclasses import dataclass, field

from tokenworks.options import option


def ints(text: str) -> tuple[int, ...]:
    return tuple(int(x) for x in text.split(",") if x)


def _ints(default: tuple[int, ...], help: str):
    return field(default=default, metadata=option(f"{help}, comma-separated", type=ints))


def _kv_dtype():
    return field(default="bf16", metadata=option("the KV cache's dtype (bf16, fp8, int8 ...)"))


def _seed():
    return field(default=0, metadata=option("of the simulation"))


def _count(default: int | None, help: str):
    return field(default=default, metadata=option(help))


def _compute_dtype():
    return field(default=None, metadata=option("default bf16 (fp8 for fp8 weights)"))


@dataclass(frozen=True, kw_only=True)
class PlanConfig:
    json: bool = field(default=False, metadata=option("machine-readable output"))


@dataclass(frozen=True, kw_only=True)
class ModelPlan(PlanConfig):
    model: str = field(metadata=option("catalogue name or path to config.json"))


@dataclass(frozen=True, kw_only=True)
class DevicePlan(ModelPlan):
    gpu: str = field(
        metadata=option(
            "catalogue name (h100, a100-40gb, ...) or this-cpu (measured)",
            flag="--gpu",
            short="--hardware",
        )
    )
    dtype: str = field(
        default="bf16",
        metadata=option(
            "weight format: bf16, fp16, fp8, int8, q8_0, q4_0, q4_1, int4-g128, or "
            "BITS[:gGROUP[:zero]]"
        ),
    )


@dataclass(frozen=True, kw_only=True)
class HardwarePlan(PlanConfig):
    probe: bool = field(default=False, metadata=option("also measure this machine"))
    threads: int | None = _count(None, "threads the probe uses (default: torch's)")


@dataclass(frozen=True, kw_only=True)
class KvPlan(ModelPlan):
    context: tuple[int, ...] = _ints((1024, 8192, 32768), "context lengths")
    kv_dtype: str = _kv_dtype()
    block_size: int | None = _count(
        None,
        "also count whole blocks of a paged cache whose windowed layers give back the "
        "blocks behind their window (the engine's pool)",
    )
    max_lora_rank: int | None = _count(
        None, "also say what one LoRA adapter of this rank on every product holds"
    )


@dataclass(frozen=True, kw_only=True)
class FitPlan(DevicePlan):
    tp: int = _count(1, "tensor-parallel devices")
    pp: int = _count(1, "pipeline-parallel stages")
    context: int | None = _count(None, "tokens (default: the model's)")
    batch: int = _count(1, "sequences that must fit at once")
    kv_dtype: str = _kv_dtype()
    utilization: float = field(default=0.9, metadata=option("share of memory to use"))
    overhead_gib: float = field(default=1.0, metadata=option("activations, runtime"))
    max_loras: int = _count(0, "LoRA adapters held at once, beside the weights")
    max_lora_rank: int = _count(16, "their rank (every attention and MLP product)")


@dataclass(frozen=True, kw_only=True)
class RooflinePlan(DevicePlan):
    batch: tuple[int, ...] = _ints((1, 8, 64, 256), "decode batches")
    context: int = _count(1024, "decode context")
    prompt: tuple[int, ...] = _ints((512,), "prefill lengths")
    kv_dtype: str = _kv_dtype()
    compute_dtype: str | None = _compute_dtype()


@dataclass(frozen=True, kw_only=True)
class QuantPlan(ModelPlan):
    formats: tuple[str, ...] = field(
        default=("bf16", "fp8", "q8_0", "q4_1", "int4-g128"),
        metadata=option("weight formats, comma-separated", type=lambda s: tuple(s.split(","))),
    )


@dataclass(frozen=True, kw_only=True)
class QueuePlan(PlanConfig):
    rate: float = field(metadata=option("arrivals per second"))
    service_mean: float = field(metadata=option("seconds per request"))
    service_cv2: float = field(default=1.0, metadata=option("squared CV (1: exponential)"))
    simulate: bool = field(default=False, metadata=option("also simulate the queue"))
    requests: int = _count(200_000, "simulated requests")
    seed: int = _seed()


@dataclass(frozen=True, kw_only=True)
class SpecPlan(PlanConfig):
    alpha: float = field(metadata=option("per-token acceptance rate"))
    k: tuple[int, ...] = _ints((1, 2, 4, 8), "draft tokens per round")
    draft_cost: float = field(default=0.1, metadata=option("draft pass / target pass"))
    monte_carlo: bool = field(default=False, metadata=option("also a Monte Carlo estimate"))
    seed: int = _seed()


@dataclass(frozen=True, kw_only=True)
class CostPlan(PlanConfig):
    price_per_hour: float = field(metadata=option("per device"))
    tokens_per_s: float = field(metadata=option("tokens a second, all devices together"))
    devices: int = _count(1, "devices")


@dataclass(frozen=True, kw_only=True)
class BatchingPlan(PlanConfig):
    requests: int = _count(256, "simulated requests")
    batch: int = _count(8, "sequences a batch")
    min_out: int = _count(16, "shortest output")
    max_out: int = _count(512, "longest output")
    seed: int = _seed()


@dataclass(frozen=True, kw_only=True)
class TrafficPlan(PlanConfig):
    elem: int = _count(4, "bytes per element")
    strides: tuple[int, ...] = _ints((1, 2, 4, 8, 32), "elements apart")
    offsets: tuple[int, ...] = _ints((0, 4), "the first address, bytes")
    matmul: tuple[int, ...] = _ints((4096, 4096, 4096), "M,N,K")
    tiles: tuple[int, ...] = _ints((32, 128), "square tile sizes")
    length: tuple[int, ...] = _ints((512, 4096, 32768), "prompt lengths")
    head_dim: int = _count(64, "a head's width")
    heads: int = _count(9, "query heads")
    kv_heads: int = _count(3, "key/value heads")


@dataclass(frozen=True, kw_only=True)
class ParallelPlan(DevicePlan):
    link: str = field(
        default="measured",
        metadata=option(
            "nvlink4, pcie4, pcie5, ib-ndr, eth-100g, eth-10g, or measured (gloo all-reduce "
            "between two processes of this machine)"
        ),
    )
    tp: tuple[int, ...] = _ints((1, 2), "tensor-parallel degrees")
    pp: tuple[int, ...] = _ints((1, 2), "pipeline stages")
    batch: tuple[int, ...] = _ints((1, 64), "decode batches")
    context: int = _count(1024, "decode context")
    prompt: int = _count(512, "prefill length")
    act_bytes: float = field(default=2.0, metadata=option("bytes of an activation"))
    devices: str | None = field(
        default=None,
        metadata=option(
            "separate: each rank its own device (default for GPUs); shared: the ranks share "
            "one machine (default for a CPU)",
            choices=["separate", "shared"],
        ),
    )
    compute_dtype: str | None = _compute_dtype()


@dataclass(frozen=True, kw_only=True)
class PagingPlan(ModelPlan):
    requests: int = _count(64, "simulated requests")
    min_len: int = _count(64, "shortest sequence")
    max_len: int = _count(2048, "longest sequence")
    reserve: int | None = _count(None, "tokens reserved per sequence")
    block_size: int = _count(16, "tokens a block")
    kv_dtype: str = _kv_dtype()
    seed: int = _seed()

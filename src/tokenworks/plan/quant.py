"""Weight quantisation: bits per weight, scales and zero points included, and weight bytes.

A group-quantised format stores `bits` per weight plus, per group of `group_size`
weights, a scale (and for asymmetric formats a zero point or minimum). GGUF Q4_0 is 4-bit
in groups of 32 with an fp16 scale: 4 + 16/32 = 4.5 bits per weight; Q4_1 adds an fp16
minimum: 5.0; Q8_0: 8.5. Per-row int8 (one scale per output row) is 8 + 16/row_len.
"""

from __future__ import annotations

from dataclasses import dataclass

from tokenworks.plan.models import ModelShape


@dataclass(frozen=True)
class QuantScheme:
    name: str
    bits: float  # per weight
    group_size: int | None = None  # weights per scale (None: no groups)
    scale_bits: int = 16
    zero_bits: int = 0  # 0 for symmetric formats

    def __post_init__(self) -> None:
        if not 0 < self.bits <= 32:
            raise ValueError(f"{self.name}: bits must be in (0, 32]")
        if self.group_size is not None and self.group_size < 1:
            raise ValueError(f"{self.name}: group_size must be >= 1")

    @property
    def bits_per_weight(self) -> float:
        if self.group_size is None:
            return self.bits
        return self.bits + (self.scale_bits + self.zero_bits) / self.group_size


SCHEMES = {
    s.name: s
    for s in (
        QuantScheme("fp32", 32),
        QuantScheme("bf16", 16),
        QuantScheme("fp16", 16),
        QuantScheme("fp8", 8),
        QuantScheme("int8", 8),  # per-tensor scale: negligible
        QuantScheme("q8_0", 8, 32),
        QuantScheme("q4_0", 4, 32),
        QuantScheme("q4_1", 4, 32, zero_bits=16),
        QuantScheme("int4-g128", 4, 128, zero_bits=16),  # GPTQ/AWQ-style asymmetric
        QuantScheme("int4-g32", 4, 32, zero_bits=16),  # tokenworks --quantization int4
        QuantScheme("fp4", 4, 16, scale_bits=8),  # NVFP4: fp8 scale per 16 (tensor scale aside)
    )
}
SCHEMES["bfloat16"], SCHEMES["float16"], SCHEMES["float32"] = (
    SCHEMES["bf16"],
    SCHEMES["fp16"],
    SCHEMES["fp32"],
)


def parse_scheme(spec: str) -> QuantScheme:
    """A known name (bf16, q4_1, int4-g128...) or BITS[:gGROUP[:zero]] e.g. '4:g64:zero'."""
    key = spec.lower()
    if key in SCHEMES:
        return SCHEMES[key]
    parts = key.split(":")
    try:
        bits = float(parts[0])
        group = None
        zero = 0
        for p in parts[1:]:
            if p.startswith("g"):
                group = int(p[1:])
            elif p == "zero":
                zero = 16
            else:
                raise ValueError(p)
    except ValueError:
        raise ValueError(
            f"unknown weight format {spec!r}; use one of {', '.join(sorted(SCHEMES))} "
            "or BITS[:gGROUP[:zero]], e.g. 4:g128:zero"
        ) from None
    return QuantScheme(spec, bits, group, zero_bits=zero)


def weight_bytes(model: ModelShape, scheme: QuantScheme, active: bool = False) -> float:
    """Bytes of the weights in this format (embeddings and norms included, at its rate)."""
    return model.params(active) * scheme.bits_per_weight / 8

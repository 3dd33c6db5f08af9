"""Accelerators and machines: memory capacity, memory bandwidth, peak arithmetic rates.

Figures are the vendors' dense (no structured sparsity) peaks; "bf16" is the tensor-core
rate with float32 accumulation where the vendor quotes both. Capacity is binary (an "80 GB"
card holds 80 GiB), bandwidth and FLOP/s decimal (see tokenworks.units). Every entry names
its source. `this-cpu` is not a catalogue entry: `plan/probe.py` measures it.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from tokenworks.units import GB, TB, TFLOPS, GiB, dtype_name


@dataclass(frozen=True)
class Hardware:
    name: str
    memory_bytes: float  # capacity of one device (binary)
    bandwidth: float  # bytes/s between memory and the compute units (decimal)
    flops: dict = field(default_factory=dict)  # dtype -> peak FLOP/s (dense)
    kind: str = "gpu"  # gpu, cpu, soc
    source: str = ""
    notes: str = ""
    measured: dict = field(default_factory=dict)  # a probe's raw figures

    def __post_init__(self) -> None:
        if self.memory_bytes <= 0 or self.bandwidth <= 0:
            raise ValueError(f"{self.name}: memory and bandwidth must be > 0")
        if any(v <= 0 for v in self.flops.values()):
            raise ValueError(f"{self.name}: peak FLOP/s must be > 0")

    def peak(self, dtype: str) -> float:
        """Peak FLOP/s for matmuls in dtype (int4/fp4 weights run at the activations' rate
        unless the device has a native rate for them)."""
        d = dtype_name(dtype)
        for candidate in (d, "bf16" if d in ("int4", "fp4", "int8", "fp8") else None, "fp16"):
            if candidate in self.flops:
                return self.flops[candidate]
        raise ValueError(f"{self.name} has no {dtype} rate; it has {', '.join(self.flops)}")

    def ridge(self, dtype: str) -> float:
        """FLOP per byte at which a kernel stops being memory-bound on this device."""
        return self.peak(dtype) / self.bandwidth


_NV = "NVIDIA {} datasheet; dense figures (half the quoted sparse ones)"

HARDWARE: dict[str, Hardware] = {
    h.name: h
    for h in (
        Hardware(
            "a100-40gb",
            40 * GiB,
            1555 * GB,
            {
                "bf16": 312 * TFLOPS,
                "fp16": 312 * TFLOPS,
                "int8": 624 * TFLOPS,
                "fp32": 19.5 * TFLOPS,
            },
            source=_NV.format("A100 Tensor Core GPU (SXM4 40GB)"),
        ),
        Hardware(
            "a100-80gb",
            80 * GiB,
            2039 * GB,
            {
                "bf16": 312 * TFLOPS,
                "fp16": 312 * TFLOPS,
                "int8": 624 * TFLOPS,
                "fp32": 19.5 * TFLOPS,
            },
            source=_NV.format("A100 Tensor Core GPU (SXM4 80GB)"),
        ),
        Hardware(
            "h100-sxm",
            80 * GiB,
            3.35 * TB,
            {
                "bf16": 989.4 * TFLOPS,
                "fp16": 989.4 * TFLOPS,
                "fp8": 1978.9 * TFLOPS,
                "int8": 1978.9 * TFLOPS,
                "fp32": 66.9 * TFLOPS,
            },
            source=_NV.format("H100 Tensor Core GPU (SXM5)"),
        ),
        Hardware(
            "h100-pcie",
            80 * GiB,
            2.0 * TB,
            {
                "bf16": 756.5 * TFLOPS,
                "fp16": 756.5 * TFLOPS,
                "fp8": 1513 * TFLOPS,
                "int8": 1513 * TFLOPS,
                "fp32": 51.2 * TFLOPS,
            },
            source=_NV.format("H100 Tensor Core GPU (PCIe)"),
        ),
        Hardware(
            "h200",
            141 * GiB,
            4.8 * TB,
            {
                "bf16": 989.4 * TFLOPS,
                "fp16": 989.4 * TFLOPS,
                "fp8": 1978.9 * TFLOPS,
                "int8": 1978.9 * TFLOPS,
                "fp32": 66.9 * TFLOPS,
            },
            source=_NV.format("H200 Tensor Core GPU (SXM)"),
        ),
        Hardware(
            "b200",
            180 * GiB,
            8.0 * TB,
            {
                "bf16": 2250 * TFLOPS,
                "fp16": 2250 * TFLOPS,
                "fp8": 4500 * TFLOPS,
                "fp4": 9000 * TFLOPS,
            },
            source=_NV.format("HGX B200 (per GPU)"),
        ),
        Hardware(
            "l4",
            24 * GiB,
            300 * GB,
            {
                "bf16": 121 * TFLOPS,
                "fp16": 121 * TFLOPS,
                "fp8": 242.5 * TFLOPS,
                "int8": 242.5 * TFLOPS,
                "fp32": 30.3 * TFLOPS,
            },
            source=_NV.format("L4 Tensor Core GPU"),
        ),
        Hardware(
            "l40s",
            48 * GiB,
            864 * GB,
            {
                "bf16": 362 * TFLOPS,
                "fp16": 362 * TFLOPS,
                "fp8": 733 * TFLOPS,
                "int8": 733 * TFLOPS,
                "fp32": 91.6 * TFLOPS,
            },
            source=_NV.format("L40S GPU"),
        ),
        Hardware(
            "mi300x",
            192 * GiB,
            5.3 * TB,
            {
                "bf16": 1307.4 * TFLOPS,
                "fp16": 1307.4 * TFLOPS,
                "fp8": 2614.9 * TFLOPS,
                "int8": 2614.9 * TFLOPS,
                "fp32": 163.4 * TFLOPS,
            },
            source="AMD Instinct MI300X data sheet; dense figures",
        ),
        Hardware(
            "rtx-4090",
            24 * GiB,
            1008 * GB,
            {
                "bf16": 165.2 * TFLOPS,
                "fp16": 165.2 * TFLOPS,
                "fp8": 330.3 * TFLOPS,
                "int8": 660.6 * TFLOPS,
                "fp32": 82.6 * TFLOPS,
            },
            source="NVIDIA Ada GPU architecture whitepaper (RTX 4090); dense, FP32 accumulate",
        ),
        Hardware(
            "m2-ultra",
            192 * GiB,
            800 * GB,
            {"fp32": 27.2 * TFLOPS, "fp16": 27.2 * TFLOPS, "bf16": 27.2 * TFLOPS},
            kind="soc",
            source="Apple M2 Ultra (76-core GPU) specifications",
            notes="unified memory; the GPU runs fp16 at about its fp32 rate",
        ),
        Hardware(
            "m3-max",
            128 * GiB,
            400 * GB,
            {"fp32": 16.4 * TFLOPS, "fp16": 16.4 * TFLOPS, "bf16": 16.4 * TFLOPS},
            kind="soc",
            source="Apple M3 Max (16-core CPU, 40-core GPU) specifications",
            notes="unified memory; the GPU runs fp16 at about its fp32 rate",
        ),
        Hardware(
            "m4-max",
            128 * GiB,
            546 * GB,
            {"fp32": 18.4 * TFLOPS, "fp16": 18.4 * TFLOPS, "bf16": 18.4 * TFLOPS},
            kind="soc",
            source="Apple M4 Max (16-core CPU, 40-core GPU) specifications",
            notes="unified memory; the GPU runs fp16 at about its fp32 rate",
        ),
    )
}

"""Units, said once: capacity is binary, rates are decimal.

Memory capacity is counted in powers of two: an "80 GB" accelerator holds 80 GiB
(80 * 2**30 bytes), and KV caches and weights are sized the same way. Bandwidth (bytes per
second) and arithmetic rates (FLOP/s) are decimal, as vendors quote them: 3.35 TB/s is
3.35e12 bytes per second, 989 TFLOP/s is 9.89e14 FLOP/s. Mixing the two is a 7% error at
GiB and 10% at TiB, which is why every number in `plan/` goes through this module.
"""

from __future__ import annotations

KiB, MiB, GiB, TiB = 2**10, 2**20, 2**30, 2**40
KB, MB, GB, TB = 10**3, 10**6, 10**9, 10**12
KFLOPS, MFLOPS, GFLOPS, TFLOPS, PFLOPS = 1e3, 1e6, 1e9, 1e12, 1e15

BYTES_PER_DTYPE = {
    "float32": 4.0,
    "fp32": 4.0,
    "bfloat16": 2.0,
    "bf16": 2.0,
    "float16": 2.0,
    "fp16": 2.0,
    "fp8": 1.0,
    "int8": 1.0,
    "int4": 0.5,
    "fp4": 0.5,
}
DTYPE_ALIASES = {"float32": "fp32", "bfloat16": "bf16", "float16": "fp16"}


def dtype_name(dtype: str) -> str:
    """The short name of a dtype (bf16, fp32, ...), refusing unknown ones."""
    d = dtype.lower()
    if d not in BYTES_PER_DTYPE:
        raise ValueError(f"unknown dtype {dtype!r}; known: {', '.join(sorted(BYTES_PER_DTYPE))}")
    return DTYPE_ALIASES.get(d, d)


def dtype_bytes(dtype: str) -> float:
    return BYTES_PER_DTYPE[dtype_name(dtype)]


def fmt_bytes(n: float) -> str:
    """A capacity, binary: 131072 -> '128 KiB', 8.6e9 -> '8.01 GiB'."""
    if n < 0:
        return "-" + fmt_bytes(-n)
    for unit, size in (("TiB", TiB), ("GiB", GiB), ("MiB", MiB), ("KiB", KiB)):
        if n >= size:
            return f"{_sig(n / size)} {unit}"
    return f"{_sig(n)} B"


def fmt_rate(n: float, unit: str = "B/s") -> str:
    """A rate, decimal: 3.35e12 -> '3.35 TB/s'; fmt_rate(9.89e14, 'FLOP/s') -> '989 TFLOP/s'."""
    for prefix, size in (("P", 1e15), ("T", 1e12), ("G", 1e9), ("M", 1e6), ("k", 1e3)):
        if abs(n) >= size:
            return f"{_sig(n / size)} {prefix}{unit}"
    return f"{_sig(n)} {unit}"


def fmt_seconds(s: float) -> str:
    if s >= 1:
        return f"{_sig(s)} s"
    if s >= 1e-3:
        return f"{_sig(s * 1e3)} ms"
    return f"{_sig(s * 1e6)} us"


def _sig(x: float) -> str:
    """Three significant figures, no exponent, no trailing zeros past the point."""
    if x == int(x) and abs(x) < 1e6:
        return str(int(x))
    digits = 2 if abs(x) < 10 else 1 if abs(x) < 100 else 0
    return f"{x:.{digits}f}"

"""Measure this machine: the figures a roofline needs, from a few seconds of torch.

- decode bandwidth: a weight-streaming matrix-vector product (`torch.mv`, what a batch-1
  decode on torch's path runs, on a 128 MiB matrix), in bfloat16 and float32: bytes of
  the matrix per second. This, not a plain copy, is what bounds decode on a CPU;
- copy bandwidth: a large tensor copy (read + write), for reference;
- matmul rates: square products (2048 x 2048 by default) in bfloat16 and float32, FLOP/s.
"""

from __future__ import annotations

import os
import time

from tokenworks.plan.hardware import Hardware
from tokenworks.units import MiB


def _best(fn, repeats: int) -> float:
    fn()  # warm-up
    best = float("inf")
    for _ in range(repeats):
        t = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - t)
    return best


def probe(
    threads: int | None = None, matrix_mib: int = 128, matmul_size: int = 2048, repeats: int = 8
) -> Hardware:
    import torch

    old = torch.get_num_threads()
    if threads:
        torch.set_num_threads(threads)
    try:
        out = {"threads": torch.get_num_threads()}
        with torch.inference_mode():
            for dtype, name in ((torch.bfloat16, "bf16"), (torch.float32, "fp32")):
                elem = torch.tensor([], dtype=dtype).element_size()
                n = int((matrix_mib * MiB / elem) ** 0.5)
                w = torch.randn(n, n).to(dtype)
                x = torch.randn(n).to(dtype)
                t = _best(lambda w=w, x=x: torch.mv(w, x), repeats)
                out[f"matvec_bandwidth_{name}"] = w.numel() * elem / t
                k = matmul_size
                a = torch.randn(k, k).to(dtype)
                b = torch.randn(k, k).to(dtype)
                t = _best(lambda a=a, b=b: a @ b, repeats)
                out[f"matmul_flops_{name}"] = 2 * k**3 / t
                del w, x, a, b
            src = torch.empty(64 * MiB, dtype=torch.uint8)
            dst = torch.empty_like(src)
            t = _best(lambda: dst.copy_(src), repeats)
            out["copy_bandwidth"] = 2 * src.numel() / t  # read + write
    finally:
        torch.set_num_threads(old)
    try:
        memory = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (ValueError, OSError):
        memory = 16 * 2**30
    return Hardware(
        "this-cpu",
        memory,
        out["matvec_bandwidth_bf16"],
        {"bf16": out["matmul_flops_bf16"], "fp32": out["matmul_flops_fp32"]},
        kind="cpu",
        source=f"measured by tokenworks.plan.probe ({out['threads']} threads)",
        notes="bandwidth is a bf16 weight-streaming matrix-vector product (decode's shape)",
        measured=out,
    )

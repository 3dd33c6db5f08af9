"""The products of a batch-1 decode step alone (csrc/decode_step.h, tw_products_pass): every
layer's QKV, output, gate-and-up and down products and the LM head, in the step's order,
on a zero row, with nothing between them but the barrier each ends with.

Set beside the whole step, it says where a decode's time goes: reading the weights through
the products, or the work between them (norms, RoPE, attention, the step's own dispatch).
"""

from __future__ import annotations

import ctypes
import time

import torch

from tokenworks.kernels import abi as ck


def products_pass_seconds(forward, repeats: int = 20) -> float | None:
    """The fastest of `repeats` passes over the products of forward's (a LlamaForward's)
    decode step, in seconds; None where a layer's feed-forward is a mixture of experts."""
    if any(m is not None for m in forward.moes):
        return None
    views = [getattr(layer, name) for layer in forward.layers_c
             for name in ("qkv", "o", "gate_up", "down")]  # fmt: skip
    views.append(forward.model_c.head)
    array = (ctypes.POINTER(ck.Linear) * len(views))(*(ctypes.pointer(v) for v in views))
    k = max(v.k for v in views)
    x, xb = torch.zeros(k), torch.zeros(k, dtype=torch.bfloat16)
    y = torch.empty(max(v.n for v in views))
    qbuf = torch.empty(forward.lib.tw_qact_bytes(1, k), dtype=torch.uint8)
    threads, best = torch.get_num_threads(), float("inf")
    args = (array, len(views), ck.ptr(x), ck.ptr(xb), ck.ptr(y), ck.ptr(qbuf), threads)
    forward.lib.tw_products_pass(*args)  # (a first pass: pages and code warm)
    for _ in range(repeats):
        t0 = time.perf_counter()
        forward.lib.tw_products_pass(*args)
        best = min(best, time.perf_counter() - t0)
    return best

"""Paged decode attention through the C kernels (csrc/decode.c, built on first use).

Reads keys and values straight out of the block pool through each sequence's block table
(no gathered copy, no padding, no mask). Where the kernels cannot be built (no compiler,
a GPU tensor) the pure-torch path in attention.py runs instead, with the same results up
to rounding.
"""

from __future__ import annotations

import ctypes

import torch

from tokenworks.ops import ckernels as ck


def load():
    """The loaded kernel library, or None where it cannot be built here."""
    return ck.library()


def paged_decode_attention(
    q, k_pool, v_pool, block_tables, context_lens, block_size, scale, window
) -> torch.Tensor | None:
    """q [B, H, D] -> [B, H, D], or None when the kernel is not available for these inputs."""
    lib = load()
    if lib is None or q.device.type != "cpu" or k_pool.dtype not in (torch.float32, torch.bfloat16):
        return None
    b, n_heads, d = q.shape
    qf = q.float().contiguous()
    out = torch.empty_like(qf)
    tables = block_tables.contiguous()
    lens = context_lens.contiguous()
    kv = ck.kv_view(tables, lens, block_size, window, ck.DTYPE_CODES[k_pool.dtype], k_pool, v_pool)
    lib.tw_paged_attention(
        ctypes.byref(kv),
        ck.ptr(qf),
        ck.ptr(out),
        b,
        n_heads,
        k_pool.shape[1],
        d,
        scale,
        torch.get_num_threads(),
    )
    return out.to(q.dtype)

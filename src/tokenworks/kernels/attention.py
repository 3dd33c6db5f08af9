"""Attention in C over the paged pool: decode tokens through their block tables, prompt
chunks in one call for the whole batch (csrc/paged_attention.h, prefill_attention.h), and
latent attention's decode (csrc/latent_attention.h).

Where a C path cannot take the inputs it says so (None or False, nothing written) and the
caller runs torch's attention (ops/attention.py) for those rows instead.
"""

from __future__ import annotations

import ctypes
import functools

import torch

from tokenworks.kernels.abi import DTYPE_CODES, KV_CODES, ONLINE_FROM, ONLINE_TILE, kv_view, ptr
from tokenworks.kernels.batch import KernelBatch
from tokenworks.kernels.build import library
from tokenworks.kernels.products import tiles_granted
from tokenworks.ops.attention import chunk_attention


def paged_decode_attention(
    q,
    k_pool,
    v_pool,
    block_tables,
    context_lens,
    block_size,
    scale,
    window,
    softcap=None,
    online=None,
    traffic=None,
    sinks=None,
) -> torch.Tensor | None:
    """q [B, H, D] -> [B, H, D], or None where the kernel cannot take these inputs;
    softcap: Gemma 2's cap on the scores (None: none); online: (tile, from which context)
    for the online softmax (None: the kernels' default, abi.ONLINE_TILE and ONLINE_FROM);
    traffic: an ops.tiled_attention.Traffic the online softmax's bytes are added to;
    sinks: gpt-oss's sink logits [H] (None: none)."""
    lib = library()
    if lib is None or q.device.type != "cpu" or DTYPE_CODES.get(k_pool.dtype) not in KV_CODES:
        return None
    b, n_heads, d = q.shape
    qf = q.float().contiguous()
    out = torch.empty_like(qf)
    tables = block_tables.contiguous()
    lens = context_lens.contiguous()
    code = DTYPE_CODES[k_pool.dtype]
    online = online or (ONLINE_TILE, ONLINE_FROM)
    counted = torch.zeros(2, dtype=torch.long) if traffic is not None else None
    sinks = None if sinks is None else sinks.float().contiguous()
    kv = kv_view(tables, lens, block_size, window, code, k_pool, v_pool, softcap, online, counted,
                 sinks)  # fmt: skip
    lib.tw_paged_attention(
        ctypes.byref(kv), ptr(qf), ptr(out), b, n_heads, k_pool.shape[1], d, scale,
        torch.get_num_threads(),
    )  # fmt: skip
    if traffic is not None:
        traffic.read += int(counted[0])
        traffic.written += int(counted[1])
    return out.to(q.dtype)


def latent_decode_attention(
    q, pool, block_tables, context_lens, block_size, scale, v_dim
) -> torch.Tensor | None:
    """Latent attention's absorbed decode (models/mla.py): q [B, H, r + rope] (the no-RoPE
    part already through W_UK) against the cached rows pool [slots, 1, r + rope], whose
    first v_dim numbers are the values -> [B, H, v_dim] float32; None where the kernel
    cannot take these inputs."""
    lib = library()
    if lib is None or q.device.type != "cpu" or DTYPE_CODES.get(pool.dtype) not in KV_CODES:
        return None
    b, n_heads, d = q.shape
    qf = q.float().contiguous()
    out = qf.new_empty(b, n_heads, v_dim)
    tables, lens = block_tables.contiguous(), context_lens.contiguous()
    kv = kv_view(tables, lens, block_size, None, DTYPE_CODES[pool.dtype], pool)
    lib.tw_latent_attention(
        ctypes.byref(kv), ptr(qf), ptr(out), b, n_heads, d, v_dim, scale, torch.get_num_threads()
    )
    return out


@functools.cache
def prefill_available() -> bool:
    """Whether prefill_attention runs here: on AMX tiles or AVX-512 BF16 dot products
    (asked of the library with an empty batch)."""
    lib = library()
    if lib is None:
        return False
    return lib.tw_prefill_attention(
        None, None, 1, 1, None, 0, None, None, None, None, None, 0, 1.0, None, 0,
        int(tiles_granted()), 1,
    ) == 0  # fmt: skip


def prefill_attention(
    q: torch.Tensor,  # [T, H, D] bfloat16, heads contiguous within a row (RoPE applied)
    k_pool: torch.Tensor,  # [slots, KVH, D] bfloat16, the chunks' own keys already written
    v_pool: torch.Tensor,
    seqs: list[tuple[int, int, torch.Tensor]],  # (first row, new rows, slots of every key)
    scale: float,
    out: torch.Tensor,  # [T, H * D] bfloat16, contiguous
    amx: bool | None = None,  # the products on AMX tiles (None: where they are granted)
) -> bool:
    """Causal attention of prompt chunks in C, into the rows of out that belong to seqs;
    each sequence's keys are its context then its new rows. False, with nothing written,
    where the kernel cannot run: no C kernels, a CPU with neither AMX nor AVX-512 BF16, a
    head_dim other than 64, or tensors not laid out as above."""
    amx = tiles_granted() if amx is None else amx and tiles_granted()
    _, h, d = q.shape
    kvh = k_pool.shape[1]
    if (
        not seqs
        or library() is None
        or d != 64
        or h % kvh
        or q.dtype != torch.bfloat16
        or k_pool.dtype != torch.bfloat16
        or v_pool.dtype != torch.bfloat16
        or out.dtype != torch.bfloat16
        or q.device.type != "cpu"
        or q.stride(2) != 1
        or q.stride(1) != d
        or not (k_pool.is_contiguous() and v_pool.is_contiguous() and out.is_contiguous())
    ):
        return False
    starts = torch.tensor([s for s, _, _ in seqs], dtype=torch.long)
    rows = torch.tensor([n for _, n, _ in seqs], dtype=torch.long)
    keys = torch.tensor([len(x) for _, _, x in seqs], dtype=torch.long)
    slots = torch.cat([x.to(torch.long) for _, _, x in seqs]).contiguous()
    slot_start = torch.cumsum(keys, 0) - keys
    done = library().tw_prefill_attention(
        ptr(k_pool), ptr(v_pool), h, kvh, q.data_ptr(), q.stride(0), ptr(starts), ptr(rows),
        ptr(slots), ptr(slot_start), ptr(keys), len(seqs), scale, ptr(out), out.stride(0),
        int(amx), torch.get_num_threads(),
    )  # fmt: skip
    return done == 0


def attend(
    q, batch: KernelBatch, k_pool, v_pool, scale, window, amx=None, softcap=None, sinks=None
) -> torch.Tensor:
    """Attention of a mixed batch (its new K/V already in the pool): q [T, H, D] ->
    [T, H * D]. Decode rows through their block tables; prompt chunks (not sliding-window,
    soft-capped or sunk ones) in one C call where it runs, else one torch attention call
    per chunk."""
    n_heads, d = q.shape[1], q.shape[2]
    out = q.new_empty(q.shape[0], n_heads * d)
    if batch.decode_rows.numel():
        qd = q.index_select(0, batch.decode_rows)
        o = paged_decode_attention(
            qd, k_pool, v_pool, batch.block_tables, batch.context_lens, batch.block_size,
            scale, window, softcap, sinks=sinks,
        )  # fmt: skip
        if o is None:
            raise RuntimeError("the C paged attention kernel cannot take these inputs")
        out[batch.decode_rows] = o.reshape(qd.shape[0], n_heads * d)
    if (
        window is None
        and softcap is None
        and sinks is None
        and prefill_attention(q, k_pool, v_pool, batch.chunks, scale, out, amx)
    ):
        return out
    for start, n, index in batch.chunks:
        out[start : start + n] = chunk_attention(
            q[start : start + n], k_pool, v_pool, index, scale, window, softcap, sinks=sinks
        )
    return out

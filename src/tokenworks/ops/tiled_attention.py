"""Exact attention in tiles, with an online softmax (FlashAttention's algorithm), in torch.

Plain attention builds every score a query has before its softmax: [rows, keys] floats,
which for a prompt of L tokens is L x L per head. Here the keys go by in tiles of
`tile_k`; each query row keeps only its running maximum m, the running sum l of
e^(score - m) and an unnormalised output acc. A new tile's scores s move them on:

    m' = max(m, max s),   l' = l e^(m - m') + sum e^(s - m'),   acc' = acc e^(m - m') + e^(s - m') V

and the answer is acc / l after the last tile: the same softmax, in one pass over K and V
and in memory of one tile of scores. Queries go by in tiles of `tile_q` positions, and a
query tile skips the key tiles its causal mask (and window) hides from all of its rows:
that is where a causal prompt saves half its work.

The query heads that share a KV head (GQA) are rows of one product against that head's
keys, so each key tile is read once for all of them. Scores and sums are float32 whatever
the inputs' dtype.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

DEFAULT_TILE = 64


@dataclass
class Traffic:
    """Bytes a tiled call reads and writes, counted as it runs (each tile's slices of Q, K
    and V as loaded, the output once), for checking plan/traffic.py's model."""

    read: int = 0
    written: int = 0


def online_attention(
    q: torch.Tensor,  # [B, KVH, n, G, D]: n query positions, G query heads per KV head
    keys: torch.Tensor,  # [B, KVH, L, D]
    values: torch.Tensor,  # [B, KVH, L, Dv]
    positions: torch.Tensor,  # [B, n] long: each query row's key index (causal: it sees keys <= it)
    scale: float,
    window: int | None = None,  # a row at p sees keys p - window + 1 .. p
    softcap: float | None = None,  # scores -> cap * tanh(scores / cap) (Gemma 2)
    tile_q: int = DEFAULT_TILE,
    tile_k: int = DEFAULT_TILE,
    traffic: Traffic | None = None,
) -> torch.Tensor:  # [B, KVH, n, G, Dv] float32
    if tile_q < 1 or tile_k < 1:
        raise ValueError(f"tile sizes must be >= 1, got tile_q={tile_q}, tile_k={tile_k}")
    b, kvh, n, g, d = q.shape
    length, dv = keys.shape[2], values.shape[-1]
    out = torch.empty(b, kvh, n, g, dv, dtype=torch.float32, device=q.device)
    key_pos = torch.arange(length, device=q.device)
    for i0 in range(0, n, tile_q):
        i1 = min(n, i0 + tile_q)
        rows = (i1 - i0) * g
        qt = q[:, :, i0:i1].reshape(b, kvh, rows, d).float() * scale
        row_pos = positions[:, i0:i1].repeat_interleave(g, dim=1)[:, None, :, None]  # [B,1,rows,1]
        m = torch.full((b, kvh, rows), -torch.inf, device=q.device)
        s_sum = torch.zeros(b, kvh, rows, device=q.device)
        acc = torch.zeros(b, kvh, rows, dv, device=q.device)
        # the key tiles some row of this query tile may see
        last = min(length, int(positions[:, i0:i1].max()) + 1)
        first = 0 if window is None else max(0, int(positions[:, i0:i1].min()) - window + 1)
        if traffic is not None:
            traffic.read += qt.numel() * q.element_size()
        for j0 in range(first // tile_k * tile_k, last, tile_k):
            j1 = min(last, j0 + tile_k)
            kt, vt = keys[:, :, j0:j1], values[:, :, j0:j1]
            if traffic is not None:
                traffic.read += kt.numel() * kt.element_size() + vt.numel() * vt.element_size()
            s = torch.matmul(qt, kt.float().transpose(-1, -2))  # [B, KVH, rows, tk]
            if softcap is not None:
                s = torch.tanh(s / softcap) * softcap
            kp = key_pos[j0:j1]
            allowed = kp <= row_pos
            if window is not None:
                allowed &= kp > row_pos - window
            s = s.masked_fill(~allowed, -torch.inf)
            m_new = torch.maximum(m, s.amax(dim=-1))
            # a row that has seen no allowed key yet keeps m = -inf; shift it by 0 instead
            shift = torch.where(torch.isinf(m_new), torch.zeros_like(m_new), m_new)
            decay = torch.exp(m - shift)
            p = torch.exp(s - shift[..., None])
            s_sum = s_sum * decay + p.sum(dim=-1)
            acc = acc * decay[..., None] + torch.matmul(p, vt.float())
            m = m_new
        out[:, :, i0:i1] = (acc / s_sum[..., None]).view(b, kvh, i1 - i0, g, dv)
    if traffic is not None:
        traffic.written += out.numel() * values.element_size()
    return out


def tiled_sequence_attention(
    qi, keys, values, scale, window=None, softcap=None, tile=DEFAULT_TILE, traffic=None
) -> torch.Tensor:
    """One sequence's causal attention, as ops.attention.sequence_attention takes it:
    qi [n, H, D]; keys, values [KVH, L, D] whose last n are qi's own -> [n, H*Dv]."""
    n, n_heads, d = qi.shape
    kvh, length = keys.shape[0], keys.shape[1]
    q = qi.reshape(n, kvh, n_heads // kvh, d).transpose(0, 1)[None]  # [1, KVH, n, G, D]
    pos = torch.arange(length - n, length, device=qi.device)[None]
    o = online_attention(q, keys[None], values[None], pos, scale, window, softcap, tile, tile,
                         traffic)  # fmt: skip
    return o[0].transpose(0, 1).reshape(n, n_heads * values.shape[-1]).to(qi.dtype)


def tiled_decode_attention(
    q, keys, values, context_lens, scale, window=None, softcap=None, tile=DEFAULT_TILE
) -> torch.Tensor:
    """A decode query per sequence over its padded context: q [B, H, D]; keys, values
    [B, KVH, L, D], sequence b's first context_lens[b] real -> [B, H*Dv]."""
    b, n_heads, d = q.shape
    kvh = keys.shape[1]
    qg = q.reshape(b, kvh, 1, n_heads // kvh, d)
    pos = (context_lens - 1).to(torch.long)[:, None]
    o = online_attention(qg, keys, values, pos, scale, window, softcap, tile, tile)
    return o.reshape(b, n_heads * values.shape[-1]).to(q.dtype)

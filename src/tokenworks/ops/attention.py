"""Attention over a flat batch of sequences, and the KV store it reads and writes.

A forward pass sees one flat batch of tokens from many sequences (prefill chunks and
decode steps mixed). `AttentionMetadata` says where each sequence's tokens lie in the
batch, how many of its tokens are already cached, and which cache row it owns. The
attention op writes the new keys/values into the cache, then attends each sequence's
queries to its whole cached context.

The KV store here is one contiguous row per sequence (`max_len` slots each), the simplest
layout that is right; the paged block pool replaces it in the batching work.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F


@dataclass
class AttentionMetadata:
    query_lens: list[int]  # new tokens of each sequence in this batch, in batch order
    context_lens: list[int]  # tokens of each sequence already in the cache
    cache_rows: list[int]  # the KV cache row each sequence owns (ignored without a cache)

    def __post_init__(self) -> None:
        if not (len(self.query_lens) == len(self.context_lens) == len(self.cache_rows)):
            raise ValueError("query_lens, context_lens and cache_rows must have equal lengths")

    @classmethod
    def single(cls, n_new: int, n_cached: int = 0, row: int = 0) -> AttentionMetadata:
        return cls([n_new], [n_cached], [row])

    @property
    def num_tokens(self) -> int:
        return sum(self.query_lens)


class KVCache:
    """Per layer, K and V of shape [rows, n_kv_heads, max_len, head_dim]."""

    def __init__(
        self,
        n_layers: int,
        rows: int,
        n_kv_heads: int,
        max_len: int,
        head_dim: int,
        dtype: torch.dtype,
        device: torch.device | str = "cpu",
    ):
        shape = (rows, n_kv_heads, max_len, head_dim)
        self.k = [torch.zeros(shape, dtype=dtype, device=device) for _ in range(n_layers)]
        self.v = [torch.zeros(shape, dtype=dtype, device=device) for _ in range(n_layers)]
        self.rows = rows
        self.max_len = max_len

    def grow(self, max_len: int) -> None:
        """Lengthen every row to max_len slots, keeping what is cached."""
        if max_len <= self.max_len:
            return
        for kv in (self.k, self.v):
            for i, old in enumerate(kv):
                new = old.new_zeros(old.shape[0], old.shape[1], max_len, old.shape[3])
                new[:, :, : self.max_len] = old
                kv[i] = new
        self.max_len = max_len

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self.k + self.v)


def _causal_mask(n_q: int, n_k: int, window: int | None, device) -> torch.Tensor:
    """[n_q, n_k] bool, True where attention is allowed; queries are the last n_q keys."""
    q_pos = torch.arange(n_k - n_q, n_k, device=device)[:, None]
    k_pos = torch.arange(n_k, device=device)[None, :]
    allowed = k_pos <= q_pos
    if window is not None:
        allowed &= k_pos > q_pos - window
    return allowed


def attention(
    q: torch.Tensor,  # [T, H, D]
    k: torch.Tensor,  # [T, KVH, D]
    v: torch.Tensor,  # [T, KVH, D]
    meta: AttentionMetadata,
    cache: KVCache | None,
    layer: int,
    scale: float,
    window: int | None = None,
) -> torch.Tensor:  # [T, H*D]
    n_heads, n_kv, d = q.shape[1], k.shape[1], q.shape[2]
    group = n_heads // n_kv
    outs = []
    start = 0
    for n, ctx, row in zip(meta.query_lens, meta.context_lens, meta.cache_rows, strict=True):
        qi, ki, vi = q[start : start + n], k[start : start + n], v[start : start + n]
        start += n
        if cache is not None:
            if ctx + n > cache.max_len:
                raise ValueError(
                    f"sequence of {ctx + n} tokens exceeds cache rows of {cache.max_len}"
                )
            kc, vc = cache.k[layer][row], cache.v[layer][row]  # [KVH, max_len, D]
            kc[:, ctx : ctx + n] = ki.transpose(0, 1)
            vc[:, ctx : ctx + n] = vi.transpose(0, 1)
            keys, values = kc[:, : ctx + n], vc[:, : ctx + n]  # [KVH, L, D]
        elif ctx:
            raise ValueError("context_lens must be 0 when running without a KV cache")
        else:
            keys, values = ki.transpose(0, 1), vi.transpose(0, 1)
        n_k = keys.shape[1]
        # SDPA takes 4-D [batch, heads, len, D]: only then does the CPU use its fused kernel
        # (3-D inputs fall back to the unfused math path, ~15x slower at 512 tokens).
        keys, values = keys[None], values[None]
        if n == 1 and (window is None or n_k <= window):
            # Decode: group the query heads that share a KV head; no mask is needed.
            qg = qi.reshape(1, n_kv, group, d)  # [1, KVH, G, D]
            o = F.scaled_dot_product_attention(qg, keys, values, scale=scale)
            outs.append(o.reshape(1, n_heads * d))
            continue
        qh = qi.transpose(0, 1)[None]  # [1, H, n, D]
        if n_k == n and window is None:
            o = F.scaled_dot_product_attention(
                qh, keys, values, is_causal=True, scale=scale, enable_gqa=True
            )
        else:
            mask = _causal_mask(n, n_k, window, q.device)
            o = F.scaled_dot_product_attention(
                qh, keys, values, attn_mask=mask, scale=scale, enable_gqa=True
            )
        outs.append(o[0].transpose(0, 1).reshape(n, n_heads * d))
    return outs[0] if len(outs) == 1 else torch.cat(outs, dim=0)

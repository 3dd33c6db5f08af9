"""Attention over a flat batch of sequences, reading and writing paged KV memory.

A forward pass sees one flat batch of tokens from many sequences: prefill chunks and
decode steps mixed. `AttentionMetadata` says how many new tokens each sequence has in the
batch (in order), how many it already has cached, where each new token's key and value are
written (`slot_mapping`, into the flat block pool of `engine/kv_cache.py`), and which
slots hold each sequence's whole context (`kv_index`, from its block table).

Two paths compute the same thing:
- the reference path gathers each sequence's keys and values through its block table and
  runs one attention call per sequence (simple, exact, and batch-invariant: a sequence's
  result never depends on what else is in the batch);
- the fast path runs every decode sequence (one new token each) in one padded, masked
  attention call, which removes a per-sequence Python loop and many small kernels.
Prefill chunks take the per-sequence path. (The C kernels lay batches out their own way:
kernels/batch.py.)
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F

from tokenworks.ops.tiled_attention import tiled_decode_attention, tiled_sequence_attention


def context_slots(table: list[int], n_tokens: int, block_size: int, start: int = 0) -> torch.Tensor:
    """[n_tokens - start] int64: the pool slot of each of a sequence's positions start to
    n_tokens - 1, through its block table."""
    pos = torch.arange(start, n_tokens)
    blocks = torch.tensor(table, dtype=torch.long)[pos // block_size]
    return blocks * block_size + pos % block_size


def window_start(context_len: int, window: int | None) -> int:
    """The first position a query at `context_len` reads with this window (0: none)."""
    return 0 if window is None else max(0, context_len - window + 1)


def chunk_attention(
    q, k_pool, v_pool, index, scale, window, softcap=None, tile=None, sinks=None
) -> torch.Tensor:
    """A prompt chunk's attention over the pool (its own K/V already written): q [n, H, D],
    index the slots of its context then its rows -> [n, H*D] (tile: see sequence_attention)."""
    keys = k_pool.index_select(0, index).transpose(0, 1)  # [KVH, ctx + n, D]
    values = v_pool.index_select(0, index).transpose(0, 1)
    return sequence_attention(q, keys, values, scale, window, softcap, tile, sinks)


def explicit_attention(q, keys, values, mask, scale: float, cap=None, sinks=None) -> torch.Tensor:
    """Attention with what SDPA cannot apply: Gemma 2's soft-capped scores, cap *
    tanh(scores / cap), and gpt-oss's sinks, a learned logit per head that joins every
    softmax's denominator (a head may attend to nothing). q [B, H, n, D]; keys, values
    [B, KVH, L, D]; mask broadcasting to [B, H, n, L] (True: may attend) or None; sinks [H]
    -> [B, H, n, Dv]."""
    group = q.shape[1] // keys.shape[1]
    keys, values = keys.repeat_interleave(group, 1), values.repeat_interleave(group, 1)
    scores = torch.matmul(q, keys.transpose(-1, -2)).float() * scale
    if cap is not None:
        scores = torch.tanh(scores / cap) * cap
    if mask is not None:
        scores = scores.masked_fill(~mask, -torch.inf)
    if sinks is None:
        probs = scores.softmax(dim=-1)
    else:
        sink = sinks.float().view(1, -1, 1, 1).expand(*scores.shape[:-1], 1)
        probs = torch.cat([scores, sink], dim=-1).softmax(dim=-1)[..., :-1]
    return torch.matmul(probs.to(values.dtype), values)


@dataclass
class DecodeBatch:
    """The decode sequences of a batch, laid out for one attention call."""

    token_rows: torch.Tensor  # [B] long: each decode token's row in the flat batch
    kv_index: torch.Tensor  # [B, L] long: context slots, padded with 0
    context_lens: torch.Tensor  # [B] long: keys each decode token attends to (itself included)
    uniform: bool = False  # every context has the same length: no padding, no mask needed
    _masks: dict = field(default_factory=dict)  # window -> [B, 1, 1, L] bool, built once a step

    def mask(self, window: int | None) -> torch.Tensor | None:
        """Which padded key slots each decode token may attend to (None: all of them)."""
        length = self.kv_index.shape[1]
        if self.uniform and (window is None or length <= window):
            return None
        if window not in self._masks:
            j = torch.arange(length, device=self.kv_index.device)[None, :]
            allowed = j < self.context_lens[:, None]  # [B, L]
            if window is not None:
                allowed &= j >= self.context_lens[:, None] - window
            self._masks[window] = allowed[:, None, None, :]
        return self._masks[window]


@dataclass
class AttentionMetadata:
    query_lens: list[int]  # new tokens of each sequence in this batch, in batch order
    context_lens: list[int]  # tokens of each sequence already in the cache
    slot_mapping: torch.Tensor | None = None  # [T] long: pool slot for each new token
    kv_index: list[torch.Tensor | None] | None = None  # per sequence: slots of its context
    decode: DecodeBatch | None = None  # set when the fast path batches the decode tokens
    # per layer, the metadata of its KV group (engine/kv_groups.py); None: this one for all
    by_layer: list[AttentionMetadata] | None = None

    def __post_init__(self) -> None:
        if len(self.query_lens) != len(self.context_lens):
            raise ValueError("query_lens and context_lens must have equal lengths")

    @classmethod
    def single(cls, n_new: int) -> AttentionMetadata:
        """One sequence, no cache (a whole-sequence forward pass)."""
        return cls([n_new], [0])

    def for_layer(self, layer: int) -> AttentionMetadata:
        """What this layer reads and writes through: its own group's block tables."""
        return self if self.by_layer is None else self.by_layer[layer]

    @classmethod
    def grouped(cls, metas: list[AttentionMetadata], group_of: list[int]) -> AttentionMetadata:
        """One metadata per KV group, each layer pointed at its group's (group_of[layer])."""
        if len(metas) == 1:
            return metas[0]
        return dataclasses.replace(metas[0], by_layer=[metas[g] for g in group_of])

    @classmethod
    def paged(
        cls,
        query_lens: list[int],
        context_lens: list[int],
        block_tables: list[list[int]],
        block_size: int,
        device: torch.device | str = "cpu",
        batch_decode: bool = True,
        window: int | None = None,  # the tables give back blocks behind this window
    ) -> AttentionMetadata:
        """Slots and gather indices from block tables (built once per step, used by every
        layer of their group). With a window, each sequence gathers only the keys its
        first new token's window reaches: the blocks before them may be gone."""
        slots: list[int] = []
        kv_index, dec_rows, dec_seq = [], [], []
        start = 0
        for n, ctx, table in zip(query_lens, context_lens, block_tables, strict=True):
            first = window_start(ctx, window)
            index = context_slots(table, ctx + n, block_size, first)
            slots.extend(index[ctx - first :].tolist())
            if batch_decode and n == 1:
                dec_rows.append(start)
                dec_seq.append(index)
                kv_index.append(None)
            else:
                kv_index.append(index.to(device))
            start += n
        decode = None
        if dec_rows:
            rows = torch.tensor(dec_rows, device=device)
            lens = torch.tensor([len(x) for x in dec_seq])
            padded = torch.zeros(len(dec_seq), int(lens.max()), dtype=torch.long)
            for j, x in enumerate(dec_seq):
                padded[j, : len(x)] = x
            uniform = int(lens.min()) == int(lens.max())
            decode = DecodeBatch(rows, padded.to(device), lens.to(device), uniform=uniform)
        slot_mapping = torch.tensor(slots, dtype=torch.long, device=device)
        return cls(query_lens, context_lens, slot_mapping, kv_index, decode)

    @property
    def num_tokens(self) -> int:
        return sum(self.query_lens)


def _causal_mask(n_q: int, n_k: int, window: int | None, device) -> torch.Tensor:
    """[n_q, n_k] bool, True where attention is allowed; queries are the last n_q keys."""
    q_pos = torch.arange(n_k - n_q, n_k, device=device)[:, None]
    k_pos = torch.arange(n_k, device=device)[None, :]
    allowed = k_pos <= q_pos
    if window is not None:
        allowed &= k_pos > q_pos - window
    return allowed


def sequence_attention(
    qi, keys, values, scale, window, softcap=None, tile=None, sinks=None
) -> torch.Tensor:
    """One sequence's causal attention: qi [n, H, D]; keys, values [KVH, L, D] (the last n
    keys are qi's own) -> [n, H*D]. tile: the online softmax over tiles of this size
    (ops/tiled_attention.py) instead of SDPA; sinks [H]: see explicit_attention."""
    if tile is not None and sinks is None:
        return tiled_sequence_attention(qi, keys, values, scale, window, softcap, tile)
    n, n_heads, d = qi.shape
    n_kv, n_k, dv = keys.shape[0], keys.shape[1], values.shape[-1]
    if softcap is not None or sinks is not None:
        mask = _causal_mask(n, n_k, window, qi.device)
        o = explicit_attention(qi.transpose(0, 1)[None], keys[None], values[None], mask,
                               scale, softcap, sinks)  # fmt: skip
        return o[0].transpose(0, 1).reshape(n, n_heads * dv)
    # SDPA takes 4-D [batch, heads, len, D]: only then does the CPU use its fused kernel
    # (3-D inputs fall back to the unfused math path, many times slower).
    keys, values = keys[None], values[None]
    if n == 1 and (window is None or n_k <= window):
        # Decode: group the query heads that share a KV head; no mask is needed.
        qg = qi.reshape(1, n_kv, n_heads // n_kv, d)  # [1, KVH, G, D]
        o = F.scaled_dot_product_attention(qg, keys, values, scale=scale)
        return o.reshape(1, n_heads * dv)
    qh = qi.transpose(0, 1)[None]  # [1, H, n, D]
    if n_k == n and window is None:
        o = F.scaled_dot_product_attention(
            qh, keys, values, is_causal=True, scale=scale, enable_gqa=True
        )
    else:
        mask = _causal_mask(n, n_k, window, qi.device)
        o = F.scaled_dot_product_attention(
            qh, keys, values, attn_mask=mask, scale=scale, enable_gqa=True
        )
    return o[0].transpose(0, 1).reshape(n, n_heads * dv)


def decode_attention(
    q, k_pool, v_pool, dec: DecodeBatch, scale, window, softcap=None, tile=None, sinks=None
) -> torch.Tensor:
    """All decode tokens in one call: q [T, H, D] -> [B, H*Dv]."""
    n_heads, d = q.shape[1], q.shape[2]
    b, length = dec.kv_index.shape
    # index_select on flat indices is a plain row copy, faster than advanced indexing
    flat = dec.kv_index.reshape(-1)
    keys = (
        k_pool.index_select(0, flat).view(b, length, *k_pool.shape[1:]).transpose(1, 2)
    )  # [B, KVH, L, D]
    values = v_pool.index_select(0, flat).view(b, length, *v_pool.shape[1:]).transpose(1, 2)
    n_kv = keys.shape[1]
    if tile is not None and sinks is None:
        qd = q.index_select(0, dec.token_rows)
        return tiled_decode_attention(qd, keys, values, dec.context_lens, scale, window, softcap,
                                      tile)  # fmt: skip
    qg = q.index_select(0, dec.token_rows).reshape(b, n_kv, n_heads // n_kv, d)  # [B,KVH,G,D]
    mask = dec.mask(window)
    if softcap is not None or sinks is not None:
        qh = qg.reshape(b, n_heads, 1, d)
        o = explicit_attention(qh, keys, values, mask, scale, softcap, sinks)
        return o.reshape(b, n_heads * values.shape[-1])
    o = F.scaled_dot_product_attention(qg, keys, values, attn_mask=mask, scale=scale)
    return o.reshape(b, n_heads * values.shape[-1])


def attention(
    q: torch.Tensor,  # [T, H, D]
    k: torch.Tensor,  # [T, KVH, D]
    v: torch.Tensor,  # [T, KVH, D]
    meta: AttentionMetadata,
    cache,  # engine.kv_pool.KVPool or None
    layer: int,
    scale: float,
    window: int | None = None,
    softcap: float | None = None,  # Gemma 2's soft-capped scores
    tile: int | None = None,  # the tiled online softmax (ops/tiled_attention.py); None: SDPA
    sinks: torch.Tensor | None = None,  # gpt-oss: [H] logits in every softmax's denominator
) -> torch.Tensor:  # [T, H*D]
    if cache is None:
        if any(meta.context_lens):
            raise ValueError("context_lens must be 0 when running without a KV cache")
        return _uncached(q, k, v, meta, scale, window, softcap, tile, sinks)
    k_pool, v_pool = cache.k[layer], cache.v[layer]
    k_pool.index_copy_(0, meta.slot_mapping, k)
    v_pool.index_copy_(0, meta.slot_mapping, v)
    return attention_over_pool(q, meta, k_pool, v_pool, scale, window, softcap, tile, sinks)


def attention_over_pool(
    q: torch.Tensor,  # [T, H, D]
    meta: AttentionMetadata,
    k_pool: torch.Tensor,  # one layer's pool, the batch's own K and V already written
    v_pool: torch.Tensor,
    scale: float,
    window: int | None = None,
    softcap: float | None = None,
    tile: int | None = None,
    sinks: torch.Tensor | None = None,
) -> torch.Tensor:  # [T, H*D]
    n_heads, dv = q.shape[1], v_pool.shape[-1]
    dec = meta.decode
    if dec is not None and dec.token_rows.numel() == q.shape[0]:  # decode only
        return decode_attention(q, k_pool, v_pool, dec, scale, window, softcap, tile, sinks)
    out = q.new_empty(q.shape[0], n_heads * dv)
    if dec is not None:
        out[dec.token_rows] = decode_attention(q, k_pool, v_pool, dec, scale, window, softcap,
                                               tile, sinks)  # fmt: skip
    start = 0
    for n, index in zip(meta.query_lens, meta.kv_index, strict=True):
        if index is not None:
            out[start : start + n] = chunk_attention(
                q[start : start + n], k_pool, v_pool, index, scale, window, softcap, tile, sinks
            )
        start += n
    return out


def _uncached(q, k, v, meta, scale, window, softcap=None, tile=None, sinks=None) -> torch.Tensor:
    outs, start = [], 0
    for n in meta.query_lens:
        sl = slice(start, start + n)
        keys, values = k[sl].transpose(0, 1), v[sl].transpose(0, 1)
        outs.append(sequence_attention(q[sl], keys, values, scale, window, softcap, tile, sinks))
        start += n
    return outs[0] if len(outs) == 1 else torch.cat(outs, dim=0)

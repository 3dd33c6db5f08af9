"""Multi-head latent attention (DeepSeek-V2, arXiv 2405.04434, section 2.1).

Each token's keys and values for all heads come from one compressed latent c (kv_lora_rank
numbers, RMS-normed) through W_UK and W_UV (kv_b_proj), plus one RoPE key k_r
(qk_rope_head_dim numbers) that every head shares. The cache holds only [c, k_r] per token
and layer: one row of the block pool, the `kv_layout` of the spec.

Two ways to attend, equal in exact arithmetic:
- expanded: rebuild every context token's per-head keys [W_UK c, k_r] and values W_UV c,
  then ordinary attention (what prefill does: its queries are many, so rebuilding once
  per chunk is cheap next to them);
- absorbed: fold W_UK into the query (q_nope W_UK: a query in latent space) and W_UV into
  the output, and attend with every head against the cached rows themselves, one shared
  "KV head" of kv_lora_rank + qk_rope_head_dim numbers (what decode does: it reads the
  small cache and never rebuilds a key).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from tokenworks.models.spec import ModelSpec
from tokenworks.ops.attention import AttentionMetadata, sequence_attention
from tokenworks.ops.linear import rows_product
from tokenworks.ops.rope import apply_rope


class LatentAttention(nn.Module):
    def __init__(self, spec: ModelSpec, layer: int):
        super().__init__()
        m = spec.mla
        self.spec, self.m, self.layer = spec, m, layer
        h, heads = spec.hidden_size, spec.n_heads
        self.dq = m.qk_nope_head_dim + m.qk_rope_head_dim
        if m.q_lora_rank:
            self.q_a = nn.Linear(h, m.q_lora_rank, bias=False)
            self.q_a_norm = nn.Parameter(torch.ones(m.q_lora_rank), requires_grad=False)
            self.q_b = nn.Linear(m.q_lora_rank, heads * self.dq, bias=False)
        else:
            self.q_proj = nn.Linear(h, heads * self.dq, bias=False)
        self.kv_a = nn.Linear(h, m.kv_lora_rank + m.qk_rope_head_dim, bias=False)
        self.kv_a_norm = nn.Parameter(torch.ones(m.kv_lora_rank), requires_grad=False)
        # W_UK and W_UV as a plain tensor, not a layer: the absorbed form reads it per head,
        # so it stays in the model dtype under --quantization
        width = heads * (m.qk_nope_head_dim + m.v_head_dim)
        self.kv_b = nn.Parameter(torch.empty(width, m.kv_lora_rank), requires_grad=False)
        self.o_proj = nn.Linear(heads * m.v_head_dim, h, bias=False)
        self.scale = spec.attn_scale or self.dq**-0.5  # (DeepSeek's YaRN scales it)
        self.absorb = True  # decode in the absorbed form (False: expanded, for comparison)
        self.tile: int | None = None  # batch-invariant mode: kv_b over fixed row tiles

    def load(self, w: dict, p: str) -> None:
        a = p + "self_attn."
        if self.m.q_lora_rank:
            self.q_a.weight.copy_(w[a + "q_a_proj.weight"])
            self.q_a_norm.copy_(w[a + "q_a_layernorm.weight"])
            self.q_b.weight.copy_(w[a + "q_b_proj.weight"])
        else:
            self.q_proj.weight.copy_(w[a + "q_proj.weight"])
        self.kv_a.weight.copy_(w[a + "kv_a_proj_with_mqa.weight"])
        self.kv_a_norm.copy_(w[a + "kv_a_layernorm.weight"])
        self.kv_b.copy_(w[a + "kv_b_proj.weight"])
        self.o_proj.weight.copy_(w[a + "o_proj.weight"])

    def _norm(self, x, weight):
        return F.rms_norm(x, (x.shape[-1],), weight, self.spec.norm_eps)

    def _w_b(self) -> tuple[torch.Tensor, torch.Tensor]:
        """W_UK [H, nope, r] and W_UV [H, v, r], views of kv_b_proj."""
        m = self.m
        w = self.kv_b.view(self.spec.n_heads, m.qk_nope_head_dim + m.v_head_dim, -1)
        return w[:, : m.qk_nope_head_dim], w[:, m.qk_nope_head_dim :]

    def project(self, x, cos, sin) -> tuple[torch.Tensor, torch.Tensor]:
        """x [T, hidden] -> (queries [T, H, dq] with RoPE applied, the rows to cache
        [T, r + rope]: each token's normed latent and its RoPE key)."""
        m, t = self.m, x.shape[0]
        q = self.q_b(self._norm(self.q_a(x), self.q_a_norm)) if m.q_lora_rank else self.q_proj(x)
        q = q.view(t, self.spec.n_heads, self.dq)
        kv = self.kv_a(x)
        latent = self._norm(kv[:, : m.kv_lora_rank], self.kv_a_norm)
        k_rope = apply_rope(kv[:, None, m.kv_lora_rank :], cos, sin)  # [T, 1, rope]
        q = torch.cat(
            [q[..., : m.qk_nope_head_dim], apply_rope(q[..., m.qk_nope_head_dim :], cos, sin)], -1
        )
        return q, torch.cat([latent, k_rope[:, 0]], dim=-1)

    def forward(self, x, cos, sin, meta: AttentionMetadata, cache) -> torch.Tensor:
        m, t, heads = self.m, x.shape[0], self.spec.n_heads
        q, rows = self.project(x, cos, sin)
        if cache is None:
            if any(meta.context_lens):
                raise ValueError("context_lens must be 0 when running without a KV cache")
            out, start = [], 0
            for n in meta.query_lens:
                out.append(self.expanded(q[start : start + n], rows[start : start + n]))
                start += n
            return self.o_proj(torch.cat(out))
        pool = cache.k[self.layer]  # [slots, 1, r + rope]
        pool.index_copy_(0, meta.slot_mapping, rows[:, None])
        out = q.new_empty(t, heads * m.v_head_dim)
        dec = meta.decode
        if dec is not None:
            if self.absorb:
                out[dec.token_rows] = self._absorbed(q.index_select(0, dec.token_rows), pool, dec)
            else:
                for j, row in enumerate(dec.token_rows.tolist()):
                    index = dec.kv_index[j, : int(dec.context_lens[j])]
                    out[row : row + 1] = self.expanded(q[row : row + 1], pool[index, 0])
        start = 0
        for n, index in zip(meta.query_lens, meta.kv_index, strict=True):
            if index is not None:
                out[start : start + n] = self.expanded(q[start : start + n], pool[index, 0])
            start += n
        return self.o_proj(out)

    def expanded(self, q: torch.Tensor, rows: torch.Tensor) -> torch.Tensor:
        """q [n, H, dq] against context rows [L, r + rope] (q's own last) -> [n, H * v]."""
        m, heads = self.m, self.spec.n_heads
        kv = rows_product(rows[:, : m.kv_lora_rank], self.kv_b, self.tile).view(
            -1, heads, m.qk_nope_head_dim + m.v_head_dim
        )
        k_rope = rows[:, None, m.kv_lora_rank :].expand(-1, heads, -1)
        keys = torch.cat([kv[..., : m.qk_nope_head_dim], k_rope], dim=-1).transpose(0, 1)
        values = kv[..., m.qk_nope_head_dim :].transpose(0, 1)  # [H, L, v]
        return sequence_attention(q, keys, values, self.scale, None)

    def latent_query(self, q: torch.Tensor) -> torch.Tensor:
        """Queries [B, H, dq] -> [B, H, r + rope]: the no-RoPE part through W_UK into the
        latent space, beside the RoPE part: queries against the cached rows themselves."""
        nope = self.m.qk_nope_head_dim
        q_latent = torch.einsum("bhn,hnr->bhr", q[..., :nope], self._w_b()[0])
        return torch.cat([q_latent, q[..., nope:]], dim=-1)

    def latent_output(self, o: torch.Tensor) -> torch.Tensor:
        """Attention outputs still in the latent space [B, H, r] -> values through W_UV,
        [B, H * v]."""
        return torch.einsum("bhr,hvr->bhv", o, self._w_b()[1]).reshape(o.shape[0], -1)

    def _absorbed(self, q: torch.Tensor, pool: torch.Tensor, dec) -> torch.Tensor:
        """Decode queries q [B, H, dq] against the cached rows themselves -> [B, H * v].
        Two batched products rather than SDPA: with one shared 576-wide "head" and values
        narrower than keys, SDPA's CPU kernels take a path several times slower."""
        query = self.latent_query(q)  # [B, H, r + rope]
        b, length = dec.kv_index.shape
        rows = pool.index_select(0, dec.kv_index.reshape(-1)).view(b, length, -1)  # [B, L, r+rope]
        scores = torch.bmm(query, rows.transpose(1, 2)).float() * self.scale  # [B, H, L]
        if not dec.uniform:
            pad = torch.arange(length, device=rows.device)[None, :] >= dec.context_lens[:, None]
            scores.masked_fill_(pad[:, None, :], -torch.inf)
        probs = scores.softmax(dim=-1).to(rows.dtype)
        latent = rows[..., : self.m.kv_lora_rank]  # each row's values: its latent
        return self.latent_output(torch.bmm(probs, latent))

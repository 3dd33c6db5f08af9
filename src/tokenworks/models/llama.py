"""The Llama-shaped decoder as plain torch modules: Llama 2/3, SmolLM2, Mistral, Qwen2 (QKV
bias), Qwen3 (per-head Q/K norm), and with models/moe.py and models/mla.py the MoE
families (Mixtral, Qwen2-MoE, Qwen3-MoE) and DeepSeek-V3's latent attention.

One decoder layer: x + attn(rmsnorm(x)), then x + mlp(rmsnorm(x)), where attn uses RoPE
and grouped-query attention (or MLA) and mlp is SwiGLU (or a mixture of SwiGLU experts).
Q, K and V are one fused matmul, and so are the gate and up projections: at batch 1 each
matmul is a pass over its weights plus a fixed per-op cost, so fewer, larger matmuls are
faster.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from tokenworks.kernels.block_linear import BlockEmbedding, BlockLinear, DenseView, dense, stored
from tokenworks.kernels.blocks import BlockTensor
from tokenworks.models.mla import LatentAttention
from tokenworks.models.moe import MoE, RoutingStats
from tokenworks.models.spec import ModelSpec
from tokenworks.ops.attention import AttentionMetadata, attention
from tokenworks.ops.rope import apply_rope, cos_sin_rows

ROPE_ROWS = 256  # positions a RoPE table grows by


def _gelu_tanh(x: torch.Tensor) -> torch.Tensor:
    return F.gelu(x, approximate="tanh")


class LlamaLayer(nn.Module):
    def __init__(self, spec: ModelSpec, layer: int):
        super().__init__()
        self.spec, self.layer = spec, layer
        h = spec.hidden_size
        self.input_norm = nn.Parameter(torch.ones(h), requires_grad=False)
        self.post_norm = nn.Parameter(torch.ones(h), requires_grad=False)
        self.mla = LatentAttention(spec, layer) if spec.mla else None
        if self.mla is None:
            self.qkv = nn.Linear(h, spec.q_size + 2 * spec.kv_size, bias=spec.qkv_bias)
            self.o_proj = nn.Linear(spec.q_size, h, bias=spec.attn_out_bias)
        # gpt-oss: a logit per head that joins every softmax's denominator
        self.sinks = nn.Parameter(torch.zeros(spec.n_heads), requires_grad=False) if (
            spec.attn_sinks) else None  # fmt: skip
        # Llama 4's weightless norms are these at 1 (before RoPE, which keeps each head's norm)
        self.head_norms = spec.qk_norm or (spec.qk_rms_norm and layer not in spec.nope_layers)
        if self.head_norms:
            q, k = (spec.q_size, spec.kv_size) if spec.qk_norm_whole else (spec.head_dim,) * 2
            self.q_norm = nn.Parameter(torch.ones(q), requires_grad=False)
            self.k_norm = nn.Parameter(torch.ones(k), requires_grad=False)
        self.moe = MoE(spec, layer) if spec.is_moe_layer(layer) else None
        if self.moe is None:
            self.gate_up = nn.Linear(h, 2 * spec.intermediate_size, bias=False)
            self.down = nn.Linear(spec.intermediate_size, h, bias=False)
        if spec.sandwich_norms:  # Gemma: each sublayer's output normed before the residual
            self.attn_output_norm = nn.Parameter(torch.ones(h), requires_grad=False)
            self.mlp_output_norm = nn.Parameter(torch.ones(h), requires_grad=False)
        self.scale = spec.attn_scale or spec.head_dim**-0.5
        self.window = spec.window(layer)
        # which RoPE table: 1 for a windowed layer with its own base (Gemma 3), else 0;
        # None for a layer that does not rotate Q and K (SmolLM3's NoPE layers)
        self.rope_table = int(spec.rope_local_theta is not None and self.window is not None)
        if layer in spec.nope_layers:
            self.rope_table = None
        self.act = F.silu if spec.mlp_act == "silu" else _gelu_tanh
        self.attention_tile: int | None = None  # tiled online-softmax attention; None: SDPA
        # (before, after) attention as torch.compile'd functions (models/compiled.py)
        self.compiled: tuple | None = None

    def load(self, blocks: dict, p: str) -> None:
        """Copy this layer's weights (engine names under prefix p) in, fusing QKV and gate/up.
        Products whose weights are GGUF BlockTensors keep them as stored (BlockLinear)."""
        w = DenseView(blocks)  # what the other modules read: floats
        if self.spec.pre_norms:
            self.input_norm.copy_(w[p + "input_layernorm.weight"])
            self.post_norm.copy_(w[p + "post_attention_layernorm.weight"])
        if self.mla is not None:
            self.mla.load(w, p)
        else:
            bias = None
            if self.spec.qkv_bias:
                bias = torch.cat([w[p + f"self_attn.{n}_proj.bias"] for n in "qkv"], dim=0)
            qkv = [blocks[p + f"self_attn.{n}_proj.weight"] for n in "qkv"]
            self.qkv = stored(self.qkv, qkv, bias)
            o_bias = w[p + "self_attn.o_proj.bias"] if self.spec.attn_out_bias else None
            self.o_proj = stored(self.o_proj, [blocks[p + "self_attn.o_proj.weight"]], o_bias)
            if self.sinks is not None:
                self.sinks.copy_(w[p + "self_attn.sinks"])
        if self.spec.qk_norm:
            self.q_norm.copy_(w[p + "self_attn.q_norm.weight"])
            self.k_norm.copy_(w[p + "self_attn.k_norm.weight"])
        if self.spec.sandwich_norms:
            self.attn_output_norm.copy_(w[p + "attn_output_norm.weight"])
            self.mlp_output_norm.copy_(w[p + "mlp_output_norm.weight"])
        if self.moe is not None:
            self.moe.load(blocks, p)
        else:
            gate_up = [blocks[p + "mlp.gate_proj.weight"], blocks[p + "mlp.up_proj.weight"]]
            self.gate_up = stored(self.gate_up, gate_up)
            self.down = stored(self.down, [blocks[p + "mlp.down_proj.weight"]])

    def forward(
        self,
        x: torch.Tensor,  # [T, hidden]
        cos: torch.Tensor,  # [T, 1, D]
        sin: torch.Tensor,
        meta: AttentionMetadata,
        cache,
        temperature: torch.Tensor | None = None,  # [T, 1, 1]: the queries' factors, or None
    ) -> torch.Tensor:
        s = self.spec
        if self.mla is not None:
            h = F.rms_norm(x, (s.hidden_size,), self.input_norm, s.norm_eps)
            return self._after_attention(x, self.mla(h, cos, sin, meta, cache))
        before, after = self.compiled or (self._before_attention, self._projected)
        q, k, v = before(x, cos, sin)
        if temperature is not None:
            q = q * temperature
        a = attention(q, k, v, meta, cache, self.layer, self.scale, self.window, s.attn_softcap,
                      self.attention_tile, self.sinks)  # fmt: skip
        return after(x, a)

    def _before_attention(self, x, cos, sin) -> tuple[torch.Tensor, ...]:
        """The input norm, QKV, Q/K norms and RoPE: [T, hidden] -> q [T, H, D], k, v."""
        s = self.spec
        h = F.rms_norm(x, (s.hidden_size,), self.input_norm, s.norm_eps) if s.pre_norms else x
        t = h.shape[0]
        qkv = self.qkv(h)  # [T, q + 2kv]
        if s.qk_norm_whole:  # OLMo 2: all of Q at once, then all of K
            q, k = qkv[:, : s.q_size], qkv[:, s.q_size : s.q_size + s.kv_size]
            qkv = torch.cat([F.rms_norm(q, (s.q_size,), self.q_norm, s.norm_eps),
                             F.rms_norm(k, (s.kv_size,), self.k_norm, s.norm_eps),
                             qkv[:, s.q_size + s.kv_size :]], dim=1)  # fmt: skip
        qk = qkv[:, : s.q_size + s.kv_size].view(t, s.n_heads + s.n_kv_heads, s.head_dim)
        if self.head_norms and not s.qk_norm_whole:
            d = (s.head_dim,)
            qk = torch.cat(
                [
                    F.rms_norm(qk[:, : s.n_heads], d, self.q_norm, s.norm_eps),
                    F.rms_norm(qk[:, s.n_heads :], d, self.k_norm, s.norm_eps),
                ],
                dim=1,
            )
        if cos is not None:
            qk = apply_rope(qk, cos, sin)
        v = qkv[:, s.q_size + s.kv_size :].view(t, s.n_kv_heads, s.head_dim)
        return qk[:, : s.n_heads], qk[:, s.n_heads :], v

    def _projected(self, x, a) -> torch.Tensor:
        return self._after_attention(x, self.o_proj(a))

    def _after_attention(self, x, a) -> torch.Tensor:
        """The rest of the layer from the attention's projected output a [T, hidden]."""
        s = self.spec
        norm = (s.hidden_size,)
        if s.sandwich_norms:
            a = F.rms_norm(a, norm, self.attn_output_norm, s.norm_eps)
        if s.residual_scale is not None:
            a = a * s.residual_scale
        x = x + a
        h = F.rms_norm(x, norm, self.post_norm, s.norm_eps) if s.pre_norms else x
        if self.moe is not None:
            m = self.moe(h)
        else:
            gate, up = self.gate_up(h).chunk(2, dim=-1)
            m = self.down(self.act(gate) * up)
        if s.sandwich_norms:
            m = F.rms_norm(m, norm, self.mlp_output_norm, s.norm_eps)
        if s.residual_scale is not None:
            m = m * s.residual_scale
        return x + m


class LlamaModel(nn.Module):
    def __init__(self, spec: ModelSpec, layers: range | None = None):
        """layers: a pipeline stage's layers only (models/pipeline.py): the embedding
        where they start at the first, the final norm and head where they end at the last."""
        super().__init__()
        self.spec = spec
        self.stage = layers if layers is not None else range(spec.n_layers)
        self.first, self.last = self.stage.start == 0, self.stage.stop == spec.n_layers
        self.embed = nn.Embedding(spec.vocab_size, spec.hidden_size) if self.first else None
        self.layers = nn.ModuleList(LlamaLayer(spec, i) for i in self.stage)
        self.norm = nn.Parameter(torch.ones(spec.hidden_size), requires_grad=False)
        self.lm_head = (
            nn.Linear(spec.hidden_size, spec.vocab_size, bias=False) if self.last else None
        )
        # RoPE tables for every position the model takes, their rows filled as positions
        # are first reached (cover_positions): untouched rows cost no memory, so a table
        # holds what the longest context served needs (Gemma 3's 32k would take 128 MiB)
        d = getattr(spec, "rope_dim", spec.head_dim)
        for name in ("cos", "sin", "cos_local", "sin_local"):
            if spec.local_rope is None and name.endswith("_local"):
                table = getattr(self, name.removesuffix("_local"))
            else:  # Gemma 3: the windowed layers have their own base
                table = torch.empty(spec.max_position, d)
            self.register_buffer(name, table, persistent=False)
        self.rope_filled = 0  # rows of the tables filled
        self.routing = RoutingStats() if spec.moe else None  # what each step's routers chose
        for layer in self.layers:
            if layer.moe is not None:
                layer.moe.stats = self.routing

    def cover_positions(self, positions: torch.Tensor | int) -> None:
        """Fill the RoPE tables' rows up to the largest of positions (an int: up to that
        many rows), a multiple of ROPE_ROWS at a time. Each row is made from its position
        alone, so a table filled in steps holds what one made whole would."""
        total = self.cos.shape[0]
        if self.rope_filled >= total:
            return
        if isinstance(positions, torch.Tensor):
            if positions.numel() == 0:
                return
            positions = int(positions.max()) + 1
        if positions <= self.rope_filled:
            return
        start, stop = self.rope_filled, min(-(-positions // ROPE_ROWS) * ROPE_ROWS, total)
        specs = [(self.cos, self.sin, self.spec)]
        if self.spec.local_rope is not None:
            specs.append((self.cos_local, self.sin_local, self.spec.local_rope))
        for cos, sin, rope in specs:
            c, s = cos_sin_rows(rope, start, stop)
            cos[start:stop], sin[start:stop] = c.to(cos.device), s.to(sin.device)
        self.rope_filled = stop

    def rope_tables(self) -> dict[str, torch.Tensor]:
        """The RoPE tables, float32 [positions, head_dim], by buffer name: they stay float32
        in a model of any dtype (each use rounds its rows to the activations' dtype, as a
        table cast once would), and the C kernels read them as they are."""
        return {n: getattr(self, n) for n in ("cos", "sin", "cos_local", "sin_local")}

    def moe_layers(self) -> list[MoE]:
        return [layer.moe for layer in self.layers if layer.moe is not None]

    def load_weights(self, w: dict) -> None:
        """Copy weights under engine names (models/arch) in: float32 tensors, or GGUF
        BlockTensors, which the products and the embedding keep as stored."""
        with torch.no_grad():
            table = w["model.embed_tokens.weight"]
            if self.first and isinstance(table, BlockTensor):
                self.embed = BlockEmbedding(table)
            elif self.first:
                self.embed.weight.copy_(table)
            self.norm.copy_(dense(w["model.norm.weight"]))
            for layer in self.layers:
                layer.load(w, f"model.layers.{layer.layer}.")
            if not self.last:
                return
            if self.spec.tie_embeddings and isinstance(table, BlockTensor):
                self.lm_head = BlockLinear([table])
            elif self.spec.tie_embeddings and self.first:
                self.lm_head.weight = self.embed.weight
            else:
                head = table if self.spec.tie_embeddings else w["lm_head.weight"]
                self.lm_head = stored(self.lm_head, [head])

    def forward(
        self,
        input_ids: torch.Tensor,  # [T] int64
        positions: torch.Tensor,  # [T] int64
        meta: AttentionMetadata,
        cache=None,
        logits_rows: torch.Tensor | None = None,  # which of the T rows need logits; None: all
        float_logits: bool = True,  # False: logits in the weights' dtype (no float32 copy)
    ) -> torch.Tensor:  # [N, vocab]
        logits = self.head(self.final_hidden(input_ids, positions, meta, cache, logits_rows))
        return logits.float() if float_logits else logits

    def final_hidden(
        self, input_ids, positions, meta: AttentionMetadata, cache=None, rows=None
    ) -> torch.Tensor:  # [N, hidden]
        """The hidden states of `rows` (None: all) after the final norm: what the head
        reads, and what an embedding pools."""
        x = self.run_layers(self.embed_input(input_ids), positions, meta, cache)
        return self.final_norm(x, rows)

    def embed_input(self, input_ids: torch.Tensor) -> torch.Tensor:  # [T] -> [T, hidden]
        x = self.embed(input_ids)
        if self.spec.embed_scale is not None:  # rounded to the model's dtype first
            x = x * torch.tensor(self.spec.embed_scale, dtype=x.dtype)
        return x

    def run_layers(self, x, positions, meta: AttentionMetadata, cache=None) -> torch.Tensor:
        """This model's layers (a pipeline stage's, or all) over x [T, hidden]."""
        self.cover_positions(positions)
        tables = [(self.cos, self.sin), (self.cos_local, self.sin_local)]
        rope = [
            (c[positions].to(x.dtype).unsqueeze(1), s[positions].to(x.dtype).unsqueeze(1))
            for c, s in tables[: 1 + (self.spec.rope_local_theta is not None)]
        ]  # each [T, 1, D]
        qt = self.spec.query_temperature
        temperature = None if qt is None else qt.factors(positions).to(x.dtype).view(-1, 1, 1)
        for layer in self.layers:
            cos, sin = (None, None) if layer.rope_table is None else rope[layer.rope_table]
            warm = qt is not None and (layer.rope_table is None or not qt.nope_only)
            t = temperature if warm else None
            x = layer(x, cos, sin, meta.for_layer(layer.layer), cache, t)
        return x

    def final_norm(self, x: torch.Tensor, rows=None) -> torch.Tensor:
        if rows is not None:
            x = x[rows]
        return F.rms_norm(x, (self.spec.hidden_size,), self.norm, self.spec.norm_eps)

    def head(self, x: torch.Tensor) -> torch.Tensor:  # [N, hidden] -> [N, vocab]
        logits = self.lm_head(x)
        if self.spec.logit_scale is not None:  # Granite
            logits = logits / self.spec.logit_scale
        if self.spec.final_softcap is not None:  # Gemma 2
            cap = self.spec.final_softcap
            logits = torch.tanh(logits / cap) * cap
        return logits

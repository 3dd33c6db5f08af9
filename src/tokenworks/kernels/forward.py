"""A Llama-family forward pass on the C kernels, two ways.

`LlamaForward.prepare(model, pool)` reads a built LlamaModel once: pointers to its weights
(float32, bfloat16, int8 with row scales, or int4 in Q4_1-style blocks), float32 copies of
the small vectors (norms, biases, scales) and of the RoPE table, and each layer's K/V pool.
Then `run` takes a batch of the paged engine (kernels/batch.py) and returns its logits:

- a decode-only batch of up to `max_rows` sequences runs the whole step in one C call
  (`tw_llama_decode`): each weight is read once for every sequence and no torch op runs
  per layer. Up to DOT_ROWS rows multiply with vector dot products on the model's own
  weights (batch-1 decode); where the packed products run and every product's shape suits
  them, bigger batches (up to PACK_MAX) multiply packed copies of the weights. Batch
  invariant (`invariant`), every batch runs the whole step, each token a row of its own
  that sees the keys up to its own, on the model's own weights: a row's logits are then
  the same bits whatever else is in the batch;
- any other batch (prompt chunks, mixed batches, bigger decode batches without packed
  products) runs `run_batched` when the weights are dense: the products through
  kernels/products.product, and C for what lies between them, three calls a layer.

Int4/int8 models without a dense copy take the first way only; MoE models (Mixtral,
Qwen2-MoE, Qwen3-MoE, gpt-oss, DeepSeek) the second only, their experts routed and run by
models/moe.py between the C calls (a GGUF's quantised experts on the file's own blocks).
So do models with latent attention (DeepSeek's MLA): its projections through the module,
then decode rows absorbed in C (`tw_latent_attention`), prompt chunks expanded in torch.
What the pass has no code for, `declines` names in words.

kernels/model_structs.py reads the model into the C structs both ways share.
"""

from __future__ import annotations

import ctypes

import torch
import torch.nn.functional as F
from torch import nn

from tokenworks.kernels import abi as ck
from tokenworks.kernels.attention import attend, latent_decode_attention
from tokenworks.kernels.batch import KernelBatch, decode_only
from tokenworks.kernels.block_linear import BlockLinear
from tokenworks.kernels.build import library
from tokenworks.kernels.model_structs import (
    MODULES,
    ModelStructs,
    batched,
    declines,
    group_windows,
    products_of,
    v_pools_of,
)
from tokenworks.kernels.products import PACK_MAX, product, swiglu

MAX_ROWS = 8  # decode batches up to this size run the whole step in C (dot products)
DOT_ROWS = 4  # packed, the whole step takes up to PACK_MAX rows; up to this many, dot products
_PRODUCTS = ("qkv", "o", "gate_up", "down")  # the same, as abi.Layer fields


def _product(d, packs: dict, act: str | None = None):
    """x -> x @ W.T for _batched's d; act: a gate_up product, followed by SwiGLU ("silu")
    or GeGLU ("gelu_tanh")."""
    if act == "gelu_tanh":
        inner = _product(d, packs)
        return lambda x: _geglu(inner(x))
    if isinstance(d, BlockLinear):
        return (lambda x: swiglu(d(x))) if act else d
    w, bias = d
    return product(w, bias, packs.get(w.data_ptr()), glu=act == "silu")


def _geglu(gu: torch.Tensor) -> torch.Tensor:
    gate, up = gu.chunk(2, dim=-1)
    return (F.gelu(gate, approximate="tanh") * up).contiguous()


class LlamaForward:
    def __init__(
        self, lib, dims, dot, amx, keep, spec, max_rows, model, pool, packs, tiles, windows,
        invariant=False,
    ):  # fmt: skip
        self.lib, self.dims, self.keep, self.spec, self.max_rows = lib, dims, keep, spec, max_rows
        self.invariant = invariant  # every batch in the whole step, a row per token
        self.layers_c, self.model_c = dot  # the C structs on the model's own weights
        self.amx = amx  # (layers, model) on packed copies (AMX tiles or vector), or None
        self.packs = packs  # weight address -> its packed copy
        self._scratch: tuple | None = None  # (rows, buffers, ck.Scratch), see _buffers
        self.pool = pool
        self.tiles = tiles  # prompt attention on AMX tiles (where granted)
        layout = pool.layout
        self.windows = windows  # each KV group's attention window (None: none)
        self.group_of = [layout.group_of(i) for i in range(spec.n_layers)]
        # each layer's (K rows, V rows, K scales, V scales): scales for an 8-bit pool only
        # (pool.k and pool.v are by layer: each a view of the pool tensor the layer uses)
        self.pool_ptrs = [
            tuple(zip(ck.pool_ptrs(k), ck.pool_ptrs(v), strict=True))
            for k, v in zip(pool.k, v_pools_of(pool), strict=True)
        ]
        self.layers = model.layers  # for what run_batched does in torch (Q/K and output norms)
        self.geglu = spec.mlp_act == "gelu_tanh"
        self.embed_scale = dot[1].embed_scale
        self.kv_dtype = ck.DTYPE_CODES[pool.k[0].dtype]
        # Bigger batches: torch's products on dense weights (or a BlockLinear's own: blocks
        # for a few rows, a dequantised tile for more), the rest in C (run_batched)
        # an MoE layer's MLP is its module (models/moe.py), called between the C calls
        # a latent-attention layer's attention is its module too (_latent)
        self.moes = [layer.moe for layer in model.layers]
        names = [products_of(layer) for layer in model.layers]
        dense = [
            [batched(getattr(layer, n)) if n else None for n in row]
            for layer, row in zip(model.layers, names, strict=True)
        ]
        head = batched(model.lm_head)
        pairs = [p for row, ns in zip(dense, names, strict=True) for p in zip(row, ns, strict=True)]
        found = [head] + [d for d, n in pairs if n]
        act = model.norm.dtype  # the model's float dtype: the products' inputs and outputs
        ok = all(d is not None and (isinstance(d, BlockLinear) or d[0].dtype == act) for d in found)
        self.dense, self.dense_head = (dense, head) if ok else (None, None)
        self.act_dtype = act if ok else None
        self.embed = model.embed  # rows of the table, as the model looks them up
        self.rope_tables = (model.cos, model.sin)  # float32 [positions, rope dims]
        self.cover_positions = model.cover_positions  # fills the tables' rows C reads
        self._packed = self._head = None  # run_batched's products, made on first use
        # LoRA adapters (engine/lora_layers.py's BatchRows: each row's adapter, set before
        # each batch): a batch where any row has one runs run_batched on the layers' own
        # modules, which add each row's deltas to the products (a GLU's before its gate)
        self.adapters = None

    @classmethod
    def prepare(
        cls,
        model: nn.Module,
        pool,
        max_rows: int | None = None,
        packed: bool = True,
        tiles: bool = True,
        invariant: bool = False,
    ) -> LlamaForward | None:
        """The forward pass for model over pool, or None where it cannot run. max_rows: the
        biggest decode batch the whole-step call takes (None: PACK_MAX when every product
        runs on packed weights, else MAX_ROWS). packed: use the packed products where this
        CPU runs them; tiles: run prompt attention on AMX tiles where granted. invariant:
        run every batch as whole-step rows on the model's own weights (the packed products
        sum in another order than the dot products, so they are left out); an MoE model,
        whose experts run between C calls, cannot."""
        lib = library()
        if lib is None or declines(model, pool):
            return None
        spec = model.spec
        windows = group_windows(spec, pool.layout)
        structs = ModelStructs(model, pool)
        keep = structs.keep
        view = structs.view
        dot = view(None)
        if dot is None:
            return None
        packs: dict = {}
        modules = spec.moe or spec.mla  # a sublayer run by its torch module between C calls
        invariant = invariant and not modules
        packed = packed and not invariant
        amx = view(packs) if packed and not spec.moe else None
        if amx is not None:
            codes = [amx[1].head.dtype] + [getattr(x, f).dtype for x in amx[0] for f in _PRODUCTS]
            if not all(c in (ck.PACKED, ck.PACKED_GLU) for c in codes):
                amx = None  # the packed weights still serve run_batched's products
        dims = ck.Dims(
            spec.hidden_size,
            spec.n_heads,
            spec.n_kv_heads,
            spec.head_dim,
            spec.intermediate_size,
            spec.vocab_size,
            spec.norm_eps,
            spec.attn_scale or spec.head_dim**-0.5,
        )
        if modules:
            max_rows = 0  # the whole step in C has neither: every batch runs run_batched
        elif max_rows is None:
            max_rows = PACK_MAX if amx is not None else MAX_ROWS
        forward = cls(
            lib, dims, dot, amx, keep, spec, max_rows, model, pool, packs, tiles, windows,
            invariant,
        )  # fmt: skip
        if modules and forward.dense is None:
            return None  # run_batched is these models' only way, and it needs every product
        return forward

    def accepts(self, query_lens: list[int]) -> bool:
        """Which batches run here (asked before one is laid out): a decode-only batch of up
        to max_rows sequences runs the whole step in C; with dense weights, any other batch
        of the paged engine runs run_batched."""
        return self._whole_step(query_lens) or self.dense is not None

    def _whole_step(self, query_lens: list[int]) -> bool:
        if self._adapted():
            return False
        return self.invariant or (len(query_lens) <= self.max_rows and decode_only(query_lens))

    def _adapted(self) -> bool:
        """Does a row of this batch run a LoRA adapter?"""
        return self.adapters is not None and self.adapters.slots is not None

    def _buffers(self, b: int) -> tuple:
        """Scratch memory for a whole step of b rows: one set, grown to the biggest batch
        seen (the C code lays rows out by the model's widths, so more rows than b serve)."""
        if self._scratch is None or self._scratch[0] < b:
            s, rows = self.spec, b
            widest = max(s.hidden_size, s.intermediate_size, s.q_size)
            bufs = {
                "h": torch.empty(rows, s.hidden_size),
                "hb": torch.empty(rows, widest, dtype=torch.bfloat16),
                "qkv": torch.empty(rows, s.q_size + 2 * s.kv_size),
                "attn": torch.empty(rows, s.q_size),
                "gu": torch.empty(rows, 2 * s.intermediate_size),
                "act": torch.empty(rows, s.intermediate_size),
                # the activations quantised for block weights (csrc/block_products.h)
                "qbuf": torch.empty(self.lib.tw_qact_bytes(rows, widest), dtype=torch.uint8),
            }
            scratch = ck.Scratch(*(ck.ptr(bufs[n]) for n, _ in ck.Scratch._fields_))
            self._scratch = (rows, bufs, scratch)
        return self._scratch[1:]

    def _kvs(self, batches: list[KernelBatch]) -> tuple:
        """Each KV group's block tables, context lengths and window for C (each layer sets
        its own pools), as an array of structs, and what they point at."""
        kvs = (ck.KV * len(batches))()
        alive = []
        for g, (batch, window) in enumerate(zip(batches, self.windows, strict=True)):
            tables = batch.block_tables.contiguous()
            lens = batch.context_lens.contiguous()
            kvs[g] = ck.kv_view(
                tables,
                lens,
                batch.block_size,
                window,
                self.kv_dtype,
                softcap=self.spec.attn_softcap,
            )
            alive += [tables, lens]
        return kvs, alive  # the tensors must outlive the call

    def run(
        self, input_ids, positions, batches: list[KernelBatch], logits_rows=None,
        float_logits=True, greedy=False,
    ) -> tuple[torch.Tensor | None, torch.Tensor | None]:  # fmt: skip
        """(logits, None): logits [rows, vocab] of logits_rows (None: every row) of the
        batch (laid out once per KV group: batches), float32 or (float_logits False) the
        dtype the path computes them in. greedy: the caller wants only each row's argmax;
        a whole decode step in C then returns (None, argmax [rows] int64), the head having
        kept each row's best and written no logits, where it runs on packed weights."""
        n = input_ids.shape[0]
        self.cover_positions(positions)
        if not self._whole_step(batches[0].query_lens):
            logits = self.run_batched(input_ids, positions, batches, logits_rows, float_logits)
            return self._final_softcap(logits), None
        if logits_rows is not None and logits_rows.numel() == n:
            logits_rows = None  # every row
        logits, choices = self._run_whole_step(input_ids, positions, batches, logits_rows, greedy)
        return self._final_softcap(logits), choices

    def _final_softcap(self, logits: torch.Tensor | None) -> torch.Tensor | None:
        """Granite's logits divided by its scale, Gemma 2's -> cap * tanh(logits / cap); the
        argmax the greedy step kept in C needs neither (both keep the order)."""
        if logits is None:
            return logits
        if self.spec.logit_scale is not None:
            logits = logits / self.spec.logit_scale
        cap = self.spec.final_softcap
        return logits if cap is None else torch.tanh(logits / cap) * cap

    def _run_whole_step(self, input_ids, positions, batches, head_rows=None, greedy=False):
        """(logits or None, argmax or None) of head_rows (ascending; None: every row)."""
        b = input_ids.shape[0]
        heads = head_rows.contiguous() if head_rows is not None else None
        r = b if heads is None else heads.numel()
        ids = input_ids.contiguous()
        pos = positions.contiguous()
        slots = torch.cat([batch.slot_mapping for batch in batches]).contiguous()  # [G, B]
        kvs, _alive = self._kvs(batches)
        _, scratch = self._buffers(b)
        x = torch.empty(b, self.spec.hidden_size)
        # a few rows: dot products on the model's weights; more: the packed products (AMX
        # tiles compute 32 rows whatever the batch, so below DOT_ROWS they only cost)
        amx = self.amx is not None and b > DOT_ROWS
        layers, model_c = self.amx if amx else (self.layers_c, self.model_c)
        # greedy: each row's argmax, which the packed head keeps (writing no logits);
        # on dot products C writes the logits, then takes their argmax
        choices = torch.empty(r, dtype=torch.long) if greedy else None
        logits = None if greedy and amx else torch.empty(r, self.spec.vocab_size)
        self.lib.tw_llama_decode(
            ctypes.byref(self.dims),
            ctypes.byref(model_c),
            layers,
            self.spec.n_layers,
            kvs,
            ck.ptr(ids),
            ck.ptr(pos),
            ck.ptr(slots),
            b,
            ck.ptr(x),
            ctypes.byref(scratch),
            ck.ptr(heads),
            -1 if heads is None else r,
            ck.ptr(logits),
            ck.ptr(choices),
            torch.get_num_threads(),
        )
        return (logits, None) if choices is None else (None, choices)

    def _attend_chunks(self, qkv, batch, layer, pos, slots, code, threads):
        """RoPE and the cache write in C, then attention over the pool (attention.attend)."""
        s = self.spec
        cos, sin = self._rope(layer)
        (k, v), (k_scale, v_scale) = self.pool_ptrs[layer]
        self.lib.tw_rope_store(
            ctypes.byref(self.dims), k, v, k_scale, v_scale, self.kv_dtype, ck.ptr(qkv), code,
            ck.ptr(pos), ck.ptr(slots), cos, sin, qkv.shape[0], threads,
        )  # fmt: skip
        q = qkv[:, : s.q_size].view(-1, s.n_heads, s.head_dim)
        window = self.windows[self.group_of[layer]]
        out = attend(
            q, batch, self.pool.k[layer], self.pool.v[layer], self.dims.attn_scale, window,
            self.tiles, self.spec.attn_softcap, self.layers[layer].sinks,
        )  # fmt: skip
        return out.contiguous()

    def _latent(self, layer: int, h, batch: KernelBatch, pos, slots) -> torch.Tensor:
        """Latent attention (models/mla.py) of h [T, hidden] -> its output projection: the
        module's products (C's where it holds a GGUF's blocks), the cache rows written,
        decode rows absorbed in C, prompt chunks expanded (their keys rebuilt once a chunk)."""
        mla = self.layers[layer].mla
        cos, sin = (t[pos].to(h.dtype).unsqueeze(1) for t in self.rope_tables)
        q, rows = mla.project(h, cos, sin)
        pool = self.pool.k[layer]  # [slots, 1, r + rope]
        pool.index_copy_(0, slots, rows[:, None].to(pool.dtype))
        out = q.new_empty(q.shape[0], self.spec.n_heads * mla.m.v_head_dim)
        if batch.decode_rows.numel():
            o = latent_decode_attention(
                mla.latent_query(q.index_select(0, batch.decode_rows)), pool, batch.block_tables,
                batch.context_lens, batch.block_size, mla.scale, mla.m.kv_lora_rank,
            )  # fmt: skip
            out[batch.decode_rows] = mla.latent_output(o.to(q.dtype))
        for start, n, index in batch.chunks:
            out[start : start + n] = mla.expanded(q[start : start + n], pool[index, 0])
        return mla.o_proj(out)

    def _rope(self, layer: int) -> tuple:
        """The RoPE table (cos, sin addresses) a layer rotates with; (None, None) for one
        that does not rotate."""
        c = self.layers_c[layer]
        if c.no_rope:
            return None, None
        return (c.cos, c.sin) if c.cos else (self.model_c.cos, self.model_c.sin)

    def _head_norms(self, qkv: torch.Tensor, layer: int) -> None:
        """Qwen3 / Gemma 3: RMSNorm over each head of Q and of K, in place in qkv (OLMo 2:
        over all of Q at once, then all of K)."""
        s, m = self.spec, self.layers[layer]
        t = qkv.shape[0]
        if s.qk_norm_whole:
            q, k = qkv[:, : s.q_size], qkv[:, s.q_size : s.q_size + s.kv_size]
            q.copy_(F.rms_norm(q, (s.q_size,), m.q_norm, s.norm_eps))
            k.copy_(F.rms_norm(k, (s.kv_size,), m.k_norm, s.norm_eps))
            return
        qk = qkv[:, : s.q_size + s.kv_size].view(t, s.n_heads + s.n_kv_heads, s.head_dim)
        d = (s.head_dim,)
        qk[:, : s.n_heads] = F.rms_norm(qk[:, : s.n_heads], d, m.q_norm, s.norm_eps)
        qk[:, s.n_heads :] = F.rms_norm(qk[:, s.n_heads :], d, m.k_norm, s.norm_eps)

    def _products(self) -> list:
        """Per layer, the four products (qkv, o, gate_up, down) as callables x -> x @ W.T,
        gate_up's followed by SwiGLU (x -> silu(x @ Wg.T) * (x @ Wu.T)).

        For decode batches the weights are packed once (a copy: the model keeps its own
        for prefill and small batches): into the packed layout where the CPU runs the packed
        products, else into oneDNN's blocked layout; both beat torch.mm on the plain weights
        for tens of rows, and oneDNN's gives bit-identical results (the packed products
        round differently only where the float32 sums do).
        """
        if self._packed is None:
            packs = self.packs
            act = "gelu_tanh" if self.geglu else "silu"
            self._packed = [
                [
                    _product(d, packs, act if name == "gate_up" else None) if d else None
                    for name, d in zip(MODULES, row, strict=True)
                ]
                for row in self.dense
            ]
            for row, moe in zip(self._packed, self.moes, strict=True):
                if moe is not None:  # the experts, routed and summed, in one call
                    row[2:] = [moe, lambda x: x]
            self._head = _product(self.dense_head, packs)
        return self._packed

    def _modules(self) -> list:
        """Per layer, the four products as the layers' modules compute them (their LoRA
        deltas included), gate_up's followed by its activation."""
        self._products()  # (the head's)
        act = _geglu if self.geglu else swiglu
        return [[m.qkv, m.o_proj, lambda x, m=m: act(m.gate_up(x)), m.down] for m in self.layers]

    def run_batched(
        self, input_ids, positions, batches: list[KernelBatch], logits_rows=None,
        float_logits=True,
    ) -> torch.Tensor:  # fmt: skip
        """Any other batch of the paged engine (big decode batches, prefill chunks, both
        mixed): torch multiplies, C does what lies between the products (residual +
        RMSNorm, RoPE + cache write, SwiGLU; decode-only batches: attention too) in 3
        calls a layer instead of about twenty torch ops; the residual stream stays float32.
        Batches with prompt rows attend through kernels/attention.attend: prompt
        chunks in one C call (AMX tiles or AVX-512 BF16) where it runs, else torch's attention.
        What Qwen3 and Gemma add (Q/K norms, output norms, GeGLU) runs in torch here."""
        lib, s, threads = self.lib, self.spec, torch.get_num_threads()
        b, act = input_ids.shape[0], self.act_dtype
        code = ck.DTYPE_CODES[act]
        pos = positions.contiguous()
        slots = [batch.slot_mapping.contiguous() for batch in batches]
        decode_only = batches[0].decode_only
        x = self.embed(input_ids)
        if self.embed_scale:  # in the model's dtype, as the torch model scales it
            x = x * torch.tensor(self.embed_scale, dtype=x.dtype)
        x = x.float().contiguous()  # [B, hidden]
        h = torch.empty(b, s.hidden_size, dtype=act)
        attn = torch.empty(b, s.q_size, dtype=act)
        px, ph, pattn = (t.data_ptr() for t in (x, h, attn))
        hid, eps = s.hidden_size, s.norm_eps
        kvs, _alive = self._kvs(batches) if decode_only else (None, None)
        dims = ctypes.byref(self.dims)
        p_delta = None
        products = self._modules() if self._adapted() else self._products()
        for i, (f_qkv, f_o, f_mlp, f_down) in enumerate(products):
            layer, g, m = self.layers_c[i], self.group_of[i], self.layers[i]
            lib.tw_residual_norm(
                px, p_delta, code, layer.input_norm, eps, ph, code, b, hid, threads
            )
            if m.mla is not None:
                proj = self._latent(i, h, batches[g], pos, slots[g])
            else:
                qkv = f_qkv(h)
                if layer.q_norm:
                    self._head_norms(qkv, i)
                if decode_only:
                    kv = kvs[g]
                    (kv.k_pool, kv.v_pool), (kv.k_scale, kv.v_scale) = self.pool_ptrs[i]
                    kv.sinks = layer.sinks
                    lib.tw_rope_attend(
                        dims, ctypes.byref(kv), qkv.data_ptr(), pattn, code, pos.data_ptr(),
                        slots[g].data_ptr(), *self._rope(i), b, threads,
                    )  # fmt: skip
                    out = attn
                else:
                    out = self._attend_chunks(qkv, batches[g], i, pos, slots[g], code, threads)
                proj = f_o(out)
            if layer.attn_out_norm:
                proj = F.rms_norm(proj, (hid,), m.attn_output_norm, eps)
            lib.tw_residual_norm(
                px, proj.data_ptr(), code, layer.post_norm, eps, ph, code, b, hid, threads
            )
            delta = f_down(f_mlp(h))
            if layer.mlp_out_norm:
                delta = F.rms_norm(delta, (hid,), m.mlp_output_norm, eps)
            p_delta = delta.data_ptr()
        lib.tw_residual_norm(
            px, p_delta, code, self.model_c.final_norm, eps, ph, code, b, hid, threads
        )
        if logits_rows is not None and logits_rows.numel() != b:
            if logits_rows.numel() == 0:  # mid-prompt chunks only: no row samples
                dtype = torch.float32 if float_logits else act
                return torch.empty(0, s.vocab_size, dtype=dtype)
            h = h.index_select(0, logits_rows)
        logits = self._head(h)
        return logits.float() if float_logits else logits

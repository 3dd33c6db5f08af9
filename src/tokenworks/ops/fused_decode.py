"""A whole Llama-family decode step in one call into the C kernels (csrc/decode.c).

`LlamaDecodeKernel.prepare(model, pool)` reads a built LlamaModel once: pointers to its
weights (float32, bfloat16, int8 with row scales, or int4 in
Q4_1-style blocks), float32 copies of the small vectors
(norms, biases, scales) and of the RoPE table, and each layer's K/V pool. `run` then takes
a decode-only batch (one new token per sequence, K/V read through block tables) and
returns its logits, with no torch op per layer.

It takes batches of up to `max_rows` sequences: each weight row is read once and used for
every sequence, which is what small batches need; big batches are compute-bound and go to
torch's matrix products instead. Batch-invariant mode and GPUs stay on the torch path
(`prepare` returns None).
"""

from __future__ import annotations

import ctypes

import torch
from torch import nn

from tokenworks.ops import ckernels as ck
from tokenworks.ops.linear import DenseForLargeBatches, Int4Linear, Int8Linear, MatvecLinear
from tokenworks.ops.rope import cos_sin_table

MAX_ROWS = 8  # decode batches up to this size run here


def _f32(t: torch.Tensor | None, keep: list) -> int | None:
    if t is None:
        return None
    t = t.detach().float().contiguous()
    keep.append(t)
    return ck.ptr(t)


def _linear(layer: nn.Module, keep: list) -> ck.Linear | None:
    """The C view of a dense or int8 layer, or None for one the kernels cannot take."""
    if isinstance(layer, DenseForLargeBatches):
        layer = layer.quantized
    n, k = layer.out_features, layer.in_features
    if isinstance(layer, Int4Linear):
        if layer.q4_blocks is None:
            return None
        w, scale, code = layer.q4_blocks, None, ck.Q4
    elif isinstance(layer, Int8Linear):
        w, scale, code = layer.qweight, layer.scale, ck.I8
    elif isinstance(layer, (nn.Linear, MatvecLinear)) and layer.weight.dtype in ck.DTYPE_CODES:
        w, scale, code = layer.weight, None, ck.DTYPE_CODES[layer.weight.dtype]
    else:
        return None
    if not w.is_contiguous():
        return None
    keep.append(w)
    return ck.Linear(ck.ptr(w), _f32(scale, keep), _f32(layer.bias, keep), code, n, k)


class LlamaDecodeKernel:
    def __init__(self, lib, dims, model_c, layers_c, keep, spec, max_rows):
        self.lib, self.dims, self.model_c, self.layers_c = lib, dims, model_c, layers_c
        self.keep, self.spec, self.max_rows = keep, spec, max_rows
        self._scratch: dict[int, tuple] = {}
        self.kv_dtype = next(ck.DTYPE_CODES[t.k[0].dtype] for t in keep if hasattr(t, "k"))

    @classmethod
    def prepare(cls, model: nn.Module, pool, max_rows: int = MAX_ROWS) -> LlamaDecodeKernel | None:
        lib = ck.library()
        spec = getattr(model, "spec", None)
        if lib is None or spec is None or spec.arch != "llama":
            return None
        if model.embed.weight.device.type != "cpu" or pool.k[0].dtype not in (
            torch.float32,
            torch.bfloat16,
        ):
            return None
        if spec.head_dim > 256 or spec.n_heads // spec.n_kv_heads * spec.head_dim > 2048:
            return None  # the kernel's per-group buffers
        keep: list = []
        layers = (ck.Layer * spec.n_layers)()
        for i, layer in enumerate(model.layers):
            parts = [_linear(getattr(layer, n), keep) for n in ("qkv", "o_proj", "gate_up", "down")]
            if any(p is None for p in parts):
                return None
            layers[i] = ck.Layer(
                _f32(layer.input_norm, keep),
                _f32(layer.post_norm, keep),
                *parts,
                ck.ptr(pool.k[i]),
                ck.ptr(pool.v[i]),
            )
        head = _linear(model.lm_head, keep)
        embed = model.embed.weight
        if head is None or embed.dtype not in (torch.float32, torch.bfloat16):
            return None
        cos, sin = cos_sin_table(spec, spec.max_position)
        keep += [embed, cos, sin, pool]
        model_c = ck.Model(
            ck.ptr(embed),
            ck.DTYPE_CODES[embed.dtype],
            _f32(model.norm, keep),
            head,
            ck.ptr(cos),
            ck.ptr(sin),
        )
        dims = ck.Dims(
            spec.hidden_size,
            spec.n_heads,
            spec.n_kv_heads,
            spec.head_dim,
            spec.intermediate_size,
            spec.vocab_size,
            spec.norm_eps,
            spec.head_dim**-0.5,
        )
        return cls(lib, dims, model_c, layers, keep, spec, max_rows)

    def accepts(self, n_tokens: int, meta) -> bool:
        """A decode-only batch with block tables (not too big for this path)."""
        dec = meta.decode
        return (
            dec is not None
            and dec.block_tables is not None
            and dec.token_rows.numel() == n_tokens
            and n_tokens <= self.max_rows
        )

    def _buffers(self, b: int) -> tuple:
        if b not in self._scratch:
            s = self.spec
            widest = max(s.hidden_size, s.intermediate_size, s.q_size)
            bufs = {
                "h": torch.empty(b, s.hidden_size),
                "hb": torch.empty(b, widest, dtype=torch.bfloat16),
                "qkv": torch.empty(b, s.q_size + 2 * s.kv_size),
                "attn": torch.empty(b, s.q_size),
                "gu": torch.empty(b, 2 * s.intermediate_size),
                "act": torch.empty(b, s.intermediate_size),
            }
            scratch = ck.Scratch(*(ck.ptr(bufs[n]) for n, _ in ck.Scratch._fields_))
            self._scratch[b] = (bufs, scratch)
        return self._scratch[b]

    def run(self, input_ids, positions, meta, window: int | None) -> torch.Tensor:
        """logits [B, vocab] float32 for a decode-only batch of B sequences."""
        dec = meta.decode
        b = input_ids.shape[0]
        ids = input_ids.contiguous()
        pos = positions.contiguous()
        slots = meta.slot_mapping.contiguous()
        tables = dec.block_tables.contiguous()
        lens = dec.context_lens.contiguous()
        kv = ck.KV(
            None,
            None,
            self.kv_dtype,
            ck.ptr(tables),
            tables.shape[1],
            ck.ptr(lens),
            dec.block_size,
            window or 0,
        )
        _, scratch = self._buffers(b)
        x = torch.empty(b, self.spec.hidden_size)
        logits = torch.empty(b, self.spec.vocab_size)
        self.lib.tw_llama_decode(
            ctypes.byref(self.dims),
            ctypes.byref(self.model_c),
            self.layers_c,
            self.spec.n_layers,
            ctypes.byref(kv),
            ck.ptr(ids),
            ck.ptr(pos),
            ck.ptr(slots),
            b,
            ck.ptr(x),
            ctypes.byref(scratch),
            ck.ptr(logits),
            torch.get_num_threads(),
        )
        return logits

"""The C kernels' calling convention: dtype codes, the structs they take, raw pointers.

Tensors cross into C as the addresses of contiguous CPU tensors; the caller keeps them
alive during the call. The structs mirror the typedefs of csrc/ field for field.
"""

from __future__ import annotations

import ctypes

import torch

F32, BF16, I8, Q4 = 0, 1, 2, 3  # Q4: ops/linear.q4_blocks
PACKED = 4  # a bfloat16 weight in products.pack_weight's layout
PACKED_GLU = 5  # a gate_up weight packed with glu=True: its product ends in SwiGLU
PARTS = 6  # a product of row ranges in different dtypes: Linear.parts, n_parts of them
BLOCKS = 16  # BLOCKS + t: a GGUF tensor of ggml type t, as stored (kernels/blocks.py)
R8 = 64  # R8 + t: the same, repacked eight rows at a time (csrc/repacked_products.h)
GLU = 101  # tw_packed_linear's y_dtype for PACKED_GLU weights: y is silu(gate) * up
E4M3 = 7  # a KV pool of float8 e4m3 bytes (csrc/kv_rows.h)
DTYPE_CODES = {torch.float32: F32, torch.bfloat16: BF16, torch.int8: I8}
if hasattr(torch, "float8_e4m3fn"):
    DTYPE_CODES[torch.float8_e4m3fn] = E4M3
KV_CODES = (F32, BF16, I8, E4M3)  # the formats a KV pool is read in (I8, E4M3: with scales)

c_ptr = ctypes.c_void_p


class Linear(ctypes.Structure):
    _fields_ = [
        ("w", c_ptr),
        ("scale", c_ptr),
        ("bias", c_ptr),
        ("dtype", ctypes.c_int),
        ("n", ctypes.c_int),
        ("k", ctypes.c_int),
        ("parts", c_ptr),  # PARTS: an array of n_parts Linear, their rows in order
        ("n_parts", ctypes.c_int),
    ]


class KV(ctypes.Structure):
    _fields_ = [
        ("k_pool", c_ptr),
        ("v_pool", c_ptr),
        ("kv_dtype", ctypes.c_int),
        ("block_tables", c_ptr),
        ("max_blocks", ctypes.c_int),
        ("context_lens", c_ptr),
        ("block_size", ctypes.c_int),
        ("window", ctypes.c_int),
        ("softcap", ctypes.c_float),
        ("tile", ctypes.c_int),
        ("tile_from", ctypes.c_int),
        ("traffic", c_ptr),
        ("k_scale", c_ptr),  # a one-byte pool's row scales (NULL: none)
        ("v_scale", c_ptr),
        ("sinks", c_ptr),  # gpt-oss's sink logits, [query heads] (NULL: none)
    ]


class Dims(ctypes.Structure):
    _fields_ = [
        ("hidden", ctypes.c_int),
        ("n_heads", ctypes.c_int),
        ("n_kv_heads", ctypes.c_int),
        ("head_dim", ctypes.c_int),
        ("intermediate", ctypes.c_int),
        ("vocab", ctypes.c_int),
        ("eps", ctypes.c_float),
        ("attn_scale", ctypes.c_float),
    ]


class Layer(ctypes.Structure):
    _fields_ = [
        ("input_norm", c_ptr),
        ("post_norm", c_ptr),
        ("qkv", Linear),
        ("o", Linear),
        ("gate_up", Linear),
        ("down", Linear),
        ("k_pool", c_ptr),
        ("v_pool", c_ptr),
        ("q_norm", c_ptr),
        ("k_norm", c_ptr),
        ("attn_out_norm", c_ptr),
        ("mlp_out_norm", c_ptr),
        ("cos", c_ptr),  # NULL: the model's table
        ("sin", c_ptr),
        ("group", ctypes.c_int),
        ("k_scale", c_ptr),  # a one-byte pool's row scales (NULL: none)
        ("v_scale", c_ptr),
        ("no_rope", ctypes.c_int),  # 1: Q and K are not rotated (SmolLM3's NoPE layers)
        ("qk_norm_whole", ctypes.c_int),  # 1: Q/K norms span all heads at once (OLMo 2)
        ("sinks", c_ptr),  # gpt-oss's sink logits, [n_heads] (NULL: none)
    ]


class Model(ctypes.Structure):
    _fields_ = [
        ("embed", c_ptr),
        ("embed_dtype", ctypes.c_int),
        ("final_norm", c_ptr),
        ("head", Linear),
        ("cos", c_ptr),
        ("sin", c_ptr),
        ("embed_scale", ctypes.c_float),  # 0: none
        ("act", ctypes.c_int),  # ACTS
    ]


ACTS = {"silu": 0, "gelu_tanh": 1}  # Model.act: SwiGLU or GeGLU


class Scratch(ctypes.Structure):
    _fields_ = [(name, c_ptr) for name in ("h", "hb", "qkv", "attn", "gu", "act", "qbuf")]


def ptr(t: torch.Tensor | None) -> int | None:
    """A contiguous CPU tensor's data address (None passes NULL)."""
    if t is None:
        return None
    if t.device.type != "cpu" or not t.is_contiguous():
        raise ValueError("the C kernels take contiguous CPU tensors")
    return t.data_ptr()


def pool_ptrs(x) -> tuple[int | None, int | None]:
    """A layer's K or V pool as (its rows' address, its row scales' address or None): a
    tensor in the model's dtype, or an 8-bit engine.kv_quant.QuantizedKV (None: NULL)."""
    if x is None:
        return None, None
    if isinstance(x, torch.Tensor):
        return ptr(x), None
    return ptr(x.data), ptr(x.scale)


# Decode attention's online softmax (csrc attend_online): keys per tile, and the context
# from which it replaces whole score rows (0: never; -1: the build's default, csrc
# online_from). See docs/kernels.md for the timing.
ONLINE_TILE, ONLINE_FROM = 64, -1


def kv_view(
    tables,
    lens,
    block_size,
    window,
    kv_dtype,
    k_pool=None,
    v_pool=None,
    softcap=None,
    online=(ONLINE_TILE, ONLINE_FROM),
    traffic=None,
    sinks=None,
) -> KV:
    """A KV struct over block tables [B, max_blocks] and context lengths [B] (int64,
    contiguous: the caller keeps them alive during the call); pools may be set later.
    softcap: Gemma 2's cap on the attention scores (None: none). online: (keys per tile,
    the context from which decode attention takes the online softmax; 0: never, -1: the
    build's default). traffic: None, or int64 [2] that the online softmax adds the bytes
    it reads and writes to. The pools: tensors, or QuantizedKV (pool_ptrs). sinks: float32
    [query heads], gpt-oss's sink logits (None: none)."""
    (k, k_scale), (v, v_scale) = pool_ptrs(k_pool), pool_ptrs(v_pool)
    return KV(
        k, v, kv_dtype, ptr(tables), tables.shape[1], ptr(lens), block_size, window or 0,
        softcap or 0.0, *online, ptr(traffic), k_scale, v_scale, ptr(sinks),
    )  # fmt: skip


# the exported functions: name -> (restype, argtypes)
_i, _f, _i64 = ctypes.c_int, ctypes.c_float, ctypes.c_int64
SIGNATURES = {
    "tw_blocks_isa": (_i, []),
    "tw_set_grids": (None, [c_ptr] * 7),
    "tw_paged_attention": (None, [ctypes.POINTER(KV), c_ptr, c_ptr, _i, _i, _i, _i, _f, _i]),
    "tw_latent_attention": (None, [ctypes.POINTER(KV), c_ptr, c_ptr, _i, _i, _i, _i, _f, _i]),
    "tw_llama_decode": (None, [
        ctypes.POINTER(Dims), ctypes.POINTER(Model), ctypes.POINTER(Layer), _i,
        ctypes.POINTER(KV), c_ptr, c_ptr, c_ptr, _i, c_ptr, ctypes.POINTER(Scratch), c_ptr,
        _i, c_ptr, c_ptr, _i,
    ]),
    "tw_residual_norm": (None, [c_ptr, c_ptr, _i, c_ptr, _f, c_ptr, _i, _i, _i, _i]),
    "tw_swiglu": (None, [c_ptr, c_ptr, _i, _i, _i, _i]),
    "tw_rope_attend": (None, [
        ctypes.POINTER(Dims), ctypes.POINTER(KV), c_ptr, c_ptr, _i, c_ptr, c_ptr, c_ptr, c_ptr,
        _i, _i,
    ]),
    "tw_rope_store": (None, [
        ctypes.POINTER(Dims), c_ptr, c_ptr, c_ptr, c_ptr, _i, c_ptr, _i, c_ptr, c_ptr, c_ptr,
        c_ptr, _i, _i,
    ]),
    "tw_argmax_rows": (None, [c_ptr, _i, _i, _i, c_ptr, _i]),
    "tw_lora_add": (None, [
        c_ptr, c_ptr, _i, _i, _i, _i, c_ptr, _i, c_ptr, c_ptr, _i, c_ptr, c_ptr, c_ptr, _i, _i,
    ]),
    "tw_block_linear": (None, [c_ptr, _i, _i, ctypes.POINTER(Linear), c_ptr, _i, _i]),
    "tw_block_dequantize": (None, [c_ptr, _i, _i64, _i, c_ptr, _i, _i]),
    "tw_blocks_use_portable": (_i, [_i]),
    "tw_r8_packs": (_i, [_i]),
    "tw_products_pass": (None, [c_ptr, _i, c_ptr, c_ptr, c_ptr, c_ptr, _i]),
    "tw_r8_exact": (_i, [_i, c_ptr, _i64, _i]),
    "tw_r8_bytes": (_i64, [_i, _i64, _i]),
    "tw_r8_pack": (None, [_i, c_ptr, _i64, _i, c_ptr, _i]),
    "tw_qact_bytes": (ctypes.c_size_t, [_i, _i]),
    "tw_stream_read": (_i64, [c_ptr, _i64, _i]),
    "tw_product_peak": (_i64, [_i, _i64, _i]),
    "tw_amx_init": (_i, []),
    "tw_use_tiles": (_i, [_i]),
    "tw_packed_kind": (_i, []),
    "tw_pack_weight": (None, [c_ptr, _i, _i, c_ptr, _i]),
    "tw_packed_linear": (_i, [c_ptr, _i, _i, c_ptr, _i, c_ptr, c_ptr, _i, _i]),
    "tw_prefill_attention": (_i, [
        c_ptr, c_ptr, _i, _i, c_ptr, _i64, c_ptr, c_ptr, c_ptr, c_ptr, c_ptr, _i, _f, c_ptr,
        _i64, _i, _i,
    ]),
}  # fmt: skip

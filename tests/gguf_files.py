"""Small GGUF files written with the gguf package for the tests: one Llama-shaped layer of
random weights, with metadata and tensors to vary."""

from __future__ import annotations

import gguf
import numpy as np

HIDDEN, FF, VOCAB, HEADS = 32, 48, 40, 4


def write_small(
    path,
    keys: dict | None = None,
    shapes: dict | None = None,
    arch="llama",
    hidden: int = HIDDEN,
    blocks=None,
):
    """A one-layer Llama-shaped file with random float32 weights; keys: metadata to add
    ({name: int, float or str}, `{arch}` filled in); shapes: tensors' shapes to replace;
    blocks(shape, seed): a layer matrix as (raw bytes, ggml type), where it gives one."""
    rng = np.random.default_rng(0)
    w = gguf.GGUFWriter(str(path), arch)
    w.add_block_count(1)
    w.add_context_length(128)
    w.add_embedding_length(hidden)
    w.add_feed_forward_length(FF)
    w.add_head_count(HEADS)
    w.add_head_count_kv(HEADS)
    w.add_layer_norm_rms_eps(1e-5)
    w.add_rope_freq_base(10000.0)
    w.add_token_list([f"t{i}" for i in range(VOCAB)])
    for key, value in (keys or {}).items():
        key = key.format(arch=arch)
        if isinstance(value, str):
            w.add_string(key, value)
        elif isinstance(value, int):
            w.add_uint32(key, value)
        else:
            w.add_float32(key, value)
    h = hidden
    tensors = {
        "token_embd.weight": (VOCAB, h),
        "output_norm.weight": (h,),
        "blk.0.attn_norm.weight": (h,),
        "blk.0.ffn_norm.weight": (h,),
        "blk.0.attn_q.weight": (h, h),
        "blk.0.attn_k.weight": (h, h),
        "blk.0.attn_v.weight": (h, h),
        "blk.0.attn_output.weight": (h, h),
        "blk.0.ffn_gate.weight": (FF, h),
        "blk.0.ffn_up.weight": (FF, h),
        "blk.0.ffn_down.weight": (h, FF),
    } | (shapes or {})
    for i, (name, shape) in enumerate(tensors.items()):  # numpy's order: rows first
        typed = blocks(shape, i) if blocks and name.startswith("blk.") and len(shape) == 2 else None
        if typed is not None:
            w.add_tensor(name, typed[0], raw_dtype=gguf.GGMLQuantizationType(typed[1]))
        else:
            w.add_tensor(name, rng.standard_normal(shape).astype(np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path

"""A random-weight GGUF the size of the models users run: Qwen2-7B's shapes (28 layers,
3,584 wide, 28 query heads over 4 key/value heads, QKV biases, a 152,064-token vocabulary)
in llama.cpp's Q4_K_M mix, written once under $TOKENWORKS_HOME/synthetic/ (about 4.4 GB).

No such model can be downloaded here, and its weights do not matter for what it measures:
load time, resident memory and the speed of the products, which depend on the shapes and
block types alone. The blocks are random bytes with their scales set so each row's
products stay near 1; the tokenizer is SmolLM2's, padded with control tokens to the
vocabulary's size."""

from __future__ import annotations

import os
from pathlib import Path

import numpy as np
from tqdm import tqdm

from tokenworks.paths import home

SHAPE = dict(hidden=3584, intermediate=18944, layers=28, heads=28, kv_heads=4, vocab=152064)
NAME = "qwen2-7b-shapes-q4_k_m.gguf"
Q4_K, Q6_K = 12, 14  # ggml's type numbers
BLOCK = {Q4_K: 144, Q6_K: 210}  # bytes per 256 weights


def _more_bits(i: int, n: int) -> bool:
    """llama.cpp's rule for which of n layers' attn_v and ffn_down get Q6_K in Q4_K_M: the
    first and last eighth, and every third layer between."""
    return i < n // 8 or i >= 7 * n // 8 or (i - n // 8) % 3 == 2


def tensor_types(layers: int) -> dict[str, int]:
    """Each matrix's block type in llama.cpp's Q4_K_M: Q6_K for the output, attn_v and
    ffn_down of the layers _more_bits picks; Q4_K for the rest."""
    types = {"token_embd.weight": Q4_K, "output.weight": Q6_K}
    for b in range(layers):
        more = Q6_K if _more_bits(b, layers) else Q4_K
        types |= {f"blk.{b}.attn_q.weight": Q4_K, f"blk.{b}.attn_k.weight": Q4_K,
                  f"blk.{b}.attn_v.weight": more, f"blk.{b}.attn_output.weight": Q4_K,
                  f"blk.{b}.ffn_gate.weight": Q4_K, f"blk.{b}.ffn_up.weight": Q4_K,
                  f"blk.{b}.ffn_down.weight": more}  # fmt: skip
    return types


def _blocks(rng, ggml_type: int, rows: int, cols: int) -> np.ndarray:
    """Random blocks [rows, row bytes] whose weights have a spread of about cols**-0.5:
    Q4_K's w = d * scale * q - dmin * min (6-bit scale and min, q 0..15; dmin = 7.5 d
    centres it); Q6_K's w = d * scale * (q - 32) (int8 scale, q 0..63)."""
    n = cols // 256
    blocks = rng.integers(0, 256, size=(rows, n, BLOCK[ggml_type]), dtype=np.uint8)
    if ggml_type == Q4_K:
        d = 1 / (256 * cols**0.5)
        scales = np.array([d, 7.5 * d], dtype=np.float16).view(np.uint8)
        blocks[:, :, :4] = scales
    else:
        blocks[:, :, 208:] = np.array([1 / (1024 * cols**0.5)], dtype=np.float16).view(np.uint8)
    return blocks.reshape(rows, -1)


def qwen2_7b_q4_k_m(tokenizer_from: str) -> Path:
    """The file (written on first use), with the tokenizer of another GGUF."""
    import gguf

    path = home() / "synthetic" / NAME
    if path.exists():
        return path
    src = gguf.GGUFReader(tokenizer_from)

    def strings(key: str) -> list[str]:
        f = src.fields[key]
        return [bytes(f.parts[i]).decode() for i in f.data]

    s = SHAPE
    tokens = strings("tokenizer.ggml.tokens")
    f = src.fields["tokenizer.ggml.token_type"]
    kinds = [int(f.parts[i][0]) for i in f.data]
    pad = s["vocab"] - len(tokens)
    tokens += [f"<|unused_{i}|>" for i in range(pad)]
    kinds += [int(gguf.TokenType.CONTROL)] * pad
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(".partial")
    w = gguf.GGUFWriter(tmp, "qwen2")
    w.add_name("random Qwen2 7B shapes (Q4_K_M)")
    w.add_context_length(32768)
    w.add_embedding_length(s["hidden"])
    w.add_block_count(s["layers"])
    w.add_feed_forward_length(s["intermediate"])
    w.add_head_count(s["heads"])
    w.add_head_count_kv(s["kv_heads"])
    w.add_rope_freq_base(1e6)
    w.add_layer_norm_rms_eps(1e-6)
    w.add_tokenizer_model("gpt2")
    w.add_token_list(tokens)
    w.add_token_merges(strings("tokenizer.ggml.merges"))
    w.add_token_types(kinds)
    w.add_bos_token_id(int(src.fields["tokenizer.ggml.bos_token_id"].contents()))
    w.add_eos_token_id(int(src.fields["tokenizer.ggml.eos_token_id"].contents()))
    h, i_, v = s["hidden"], s["intermediate"], s["vocab"]
    kv = h // s["heads"] * s["kv_heads"]
    rows = {"token_embd": (v, h), "output": (v, h), "attn_q": (h, h), "attn_k": (kv, h),
            "attn_v": (kv, h), "attn_output": (h, h), "ffn_gate": (i_, h), "ffn_up": (i_, h),
            "ffn_down": (h, i_)}  # fmt: skip
    types = tensor_types(s["layers"])
    shapes = {name: rows[name.split(".")[-2]] for name in types}
    floats = {"output_norm.weight": h}
    for b in range(s["layers"]):
        floats |= {f"blk.{b}.attn_norm.weight": h, f"blk.{b}.ffn_norm.weight": h,
                   f"blk.{b}.attn_q.bias": h, f"blk.{b}.attn_k.bias": kv,
                   f"blk.{b}.attn_v.bias": kv}  # fmt: skip
    for name, (r, c) in shapes.items():
        nbytes = c // 256 * BLOCK[types[name]]
        w.add_tensor_info(name, (r, nbytes), np.dtype(np.uint8), r * nbytes, raw_dtype=types[name])
    for name, n in floats.items():
        w.add_tensor_info(name, (n,), np.dtype(np.float32), n * 4)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_ti_data_to_file()
    rng = np.random.default_rng(0)
    for name, (r, c) in tqdm(shapes.items(), desc=f"write {NAME}", unit="tensor"):
        w.write_tensor_data(_blocks(rng, types[name], r, c))
    for name, n in floats.items():
        if name.endswith(".bias"):  # small random biases, norms of ones
            w.write_tensor_data(rng.normal(0, 0.02, n).astype(np.float32))
        else:
            w.write_tensor_data(np.ones(n, np.float32))
    w.close()
    os.replace(tmp, path)
    return path

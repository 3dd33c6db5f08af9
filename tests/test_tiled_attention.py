"""Tiled exact attention (ops/tiled_attention.py) against the float64 definition."""

from __future__ import annotations

import pytest
import torch

from tokenworks.ops.tiled_attention import (
    Traffic,
    tiled_decode_attention,
    tiled_sequence_attention,
)


def reference(q, keys, values, scale, window=None, softcap=None, positions=None, sinks=None):
    """softmax(q k^T) v in float64, a block of 256 query rows at a time: q [n, H, D];
    keys, values [KVH, L, D]; row i at key position positions[i] (default: the last n);
    sinks [H]: a logit per head in each softmax's denominator (gpt-oss)."""
    n, h, _ = q.shape
    kvh, length = keys.shape[0], keys.shape[1]
    k = keys.double().repeat_interleave(h // kvh, 0)
    v = values.double().repeat_interleave(h // kvh, 0)
    if positions is None:
        positions = torch.arange(length - n, length)
    out = []
    for i0 in range(0, n, 256):
        qb = q[i0 : i0 + 256].double().transpose(0, 1)  # [H, b, D]
        s = qb @ k.transpose(1, 2) * scale
        if softcap is not None:
            s = torch.tanh(s / softcap) * softcap
        p = positions[i0 : i0 + 256, None]
        j = torch.arange(length)[None]
        allowed = j <= p
        if window is not None:
            allowed &= j > p - window
        s = s.masked_fill(~allowed[None], -torch.inf)
        if sinks is None:
            probs = s.softmax(-1)
        else:
            sink = sinks.double()[:, None, None].expand(*s.shape[:-1], 1)
            probs = torch.cat([s, sink], -1).softmax(-1)[..., :-1]
        out.append((probs @ v).transpose(0, 1).reshape(qb.shape[1], -1))
    return torch.cat(out)


CASES = [  # (length, query rows, tile)
    (1, 1, 16), (2, 2, 16), (17, 17, 16), (100, 100, 64), (300, 40, 16), (1000, 1000, 256),
    (1000, 1000, 16), (8192, 8192, 256), (8192, 64, 128),
]  # fmt: skip


MASKS = [(None, None), (37, None), (None, 30.0), (200, 20.0)]  # (window, softcap)
# every case with every mask, but 8,192 rows only once (the float64 side takes ~20 s)
PROMPTS = [c + m for c in CASES for m in MASKS if c[1] < 8192 or m == (None, None)]


@pytest.mark.parametrize(("length", "rows", "tile", "window", "softcap"), PROMPTS)
def test_tiled_prompt_attention_equals_the_float64_definition(length, rows, tile, window, softcap):
    """Lengths 1 to 8,192, tiles 16 to 256, with windows, soft-capping and GQA (4 query
    heads on 2 KV heads); a chunk's rows are the last of its keys, as after a cached prefix."""
    g = torch.Generator().manual_seed(length + tile)
    q = torch.randn(rows, 4, 32, generator=g)
    keys, values = torch.randn(2, length, 32, generator=g), torch.randn(2, length, 32, generator=g)
    got = tiled_sequence_attention(q, keys, values, 32**-0.5, window, softcap, tile)
    want = reference(q, keys, values, 32**-0.5, window, softcap)
    torch.testing.assert_close(got.double(), want, atol=2e-6, rtol=1e-5)


@pytest.mark.parametrize("tile", [16, 256])
@pytest.mark.parametrize("window", [None, 50])
def test_tiled_decode_attention_reads_only_each_sequences_context(tile, window):
    """Decode queries over padded contexts of different lengths (padding filled with
    garbage that must not count) equal the definition, one sequence at a time."""
    g = torch.Generator().manual_seed(tile)
    lens = torch.tensor([1, 70, 300, 17])
    keys = torch.randn(4, 2, 300, 64, generator=g) * 3
    values = torch.randn(4, 2, 300, 64, generator=g)
    q = torch.randn(4, 6, 64, generator=g)
    got = tiled_decode_attention(q, keys, values, lens, 0.125, window, 25.0, tile)
    for b, n in enumerate(lens.tolist()):
        want = reference(q[b : b + 1], keys[b, :, :n], values[b, :, :n], 0.125, window, 25.0)
        torch.testing.assert_close(got[b : b + 1].double(), want, atol=2e-6, rtol=1e-5)


def test_bfloat16_inputs_keep_float32_sums():
    """bfloat16 Q, K and V: the result is the float32 definition on those same values,
    rounded once to bfloat16 at the end."""
    g = torch.Generator().manual_seed(3)
    q, k, v = (
        torch.randn(*s, generator=g).bfloat16() for s in ((64, 4, 64), (2, 64, 64), (2, 64, 64))
    )
    got = tiled_sequence_attention(q, k, v, 0.125, tile=16)
    assert got.dtype == torch.bfloat16
    want = reference(q, k, v, 0.125).bfloat16()
    assert (got.float() - want.float()).abs().max() <= 2 * 2**-8 * want.float().abs().max()


def test_a_causal_prompt_reads_about_half_the_key_tiles():
    """Counted traffic: the key tiles above the diagonal are skipped, so K and V are read
    (n/t)(n/t + 1)/2 times a tile, not (n/t)^2."""
    n, t, d = 256, 32, 16
    q, k, v = torch.randn(n, 1, d), torch.randn(1, n, d), torch.randn(1, n, d)
    traffic = Traffic()
    tiled_sequence_attention(q, k, v, 0.25, tile=t, traffic=traffic)
    tiles = n // t
    kv_bytes = tiles * (tiles + 1) // 2 * 2 * t * d * 4
    assert traffic.read == n * d * 4 + kv_bytes
    assert traffic.written == n * d * 4


def test_bad_tiles_are_refused():
    q = torch.randn(4, 1, 8)
    with pytest.raises(ValueError, match="tile sizes must be >= 1"):
        tiled_sequence_attention(q, q.transpose(0, 1), q.transpose(0, 1), 1.0, tile=0)

"""plan/traffic.py's closed forms against brute-force counts on small cases."""

from __future__ import annotations

import itertools

import pytest
import torch

from tokenworks.ops.tiled_attention import Traffic, tiled_sequence_attention
from tokenworks.plan import traffic as tr


def test_warp_sectors_equal_the_sectors_every_byte_touches():
    for stride, offset, elem in itertools.product(range(1, 41), range(0, 70, 3), (1, 2, 4, 8, 16)):
        touched = {
            (offset + i * stride * elem + b) // tr.SECTOR
            for i in range(tr.WARP)
            for b in range(elem)
        }
        assert tr.warp_sectors(stride, offset, elem) == len(touched), (stride, offset, elem)
    assert tr.coalescing_efficiency(1) == 1.0
    assert tr.coalescing_efficiency(32) == 4 / 32


def _tiled_matmul_loads(m, n, k, bm, bn) -> int:
    """Elements brought in by a loop over output tiles that loads its A rows and B columns."""
    loads = 0
    for i0, j0 in itertools.product(range(0, m, bm), range(0, n, bn)):
        rows, cols = min(bm, m - i0), min(bn, n - j0)
        loads += rows * k + k * cols
    return loads + m * n  # each output written once


@pytest.mark.parametrize(("m", "n", "k"), [(5, 7, 3), (16, 16, 16), (33, 17, 9)])
@pytest.mark.parametrize("tile", [(1, 1), (4, 4), (8, 3), (16, 32)])
def test_tiled_matmul_bytes_equal_a_counted_tile_loop(m, n, k, tile):
    assert tr.matmul_bytes(m, n, k, 2, tile) == 2 * _tiled_matmul_loads(m, n, k, *tile)
    assert tr.matmul_bytes(m, n, k, 2, None) == 2 * (m * n * 2 * k + m * n)


def _naive_attention_counted(n, d, heads, kv_heads, elem=4) -> int:
    """Each buffer's reads and writes as the naive form does them, one element at a time."""
    moved = 0
    for _h in range(heads):
        moved += n * d * elem  # Q read
        moved += n * n * 4  # S = QK^T written
        moved += 2 * n * n * 4  # softmax: S read, P written
        moved += n * n * 4  # PV: P read
        moved += n * d * elem  # O written
    moved += kv_heads * 2 * n * d * elem  # K and V read
    return moved


@pytest.mark.parametrize(("n", "heads", "kv_heads"), [(1, 1, 1), (17, 4, 2), (64, 9, 3)])
def test_naive_attention_bytes_equal_the_counted_buffers(n, heads, kv_heads):
    shape = tr.AttentionShape(n, n, 16, heads, kv_heads)
    assert tr.naive_attention_bytes(shape) == _naive_attention_counted(n, 16, heads, kv_heads)


@pytest.mark.parametrize(("n", "length"), [(1, 1), (37, 37), (100, 100), (20, 150), (256, 256)])
@pytest.mark.parametrize("tile", [16, 64])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_tiled_attention_bytes_equal_what_the_torch_implementation_moves(n, length, tile, dtype):
    """ops/tiled_attention.py counts the tiles it loads; the model predicts the count."""
    q = torch.randn(n, 6, 16).to(dtype)
    k, v = torch.randn(2, length, 16).to(dtype), torch.randn(2, length, 16).to(dtype)
    counted = Traffic()
    tiled_sequence_attention(q, k, v, 0.25, tile=tile, traffic=counted)
    shape = tr.AttentionShape(n, length, 16, 6, 2, elem=q.element_size())
    assert tr.tiled_attention_bytes(shape, tile, tile) == counted.read + counted.written


def test_tiled_attention_moves_far_less_than_naive_at_length():
    shape = tr.AttentionShape(4096, 4096, 64, 9, 3)
    assert tr.naive_attention_bytes(shape) > 5 * tr.tiled_attention_bytes(shape, 128, 128)


@pytest.mark.parametrize("window", [None, 40])
@pytest.mark.parametrize("tile", [16, 64])
def test_tiled_attention_bytes_equal_what_the_c_kernel_moves(window, tile):
    """The C decode kernel's online softmax counts the bytes it loads and stores (csrc
    count_bytes); per sequence the model's one-query tiled attention over its keys (a
    window's last keys only) predicts them."""
    from tokenworks.engine.kv_pool import KVPool
    from tokenworks.kernels import attention as kattention
    from tokenworks.kernels import build

    if build.library() is None:
        pytest.skip("the C kernel is not built here")
    n_heads, n_kv, d, bs = 6, 2, 16, 8
    lens = [1, 9, 100, 333]
    blocks = [-(-n // bs) for n in lens]
    pool = KVPool(1, sum(blocks), bs, n_kv, d, torch.float32)
    tables = torch.zeros(len(lens), max(blocks), dtype=torch.long)
    at = 0
    for i, nb in enumerate(blocks):
        tables[i, :nb] = torch.arange(at, at + nb)
        at += nb
    counted = Traffic()
    kattention.paged_decode_attention(
        torch.randn(len(lens), n_heads, d), pool.k[0], pool.v[0], tables, torch.tensor(lens), bs,
        0.25, window, online=(tile, 1), traffic=counted,
    )  # fmt: skip
    shapes = [tr.AttentionShape(1, min(n, window or n), d, n_heads, n_kv) for n in lens]
    want = sum(tr.tiled_attention_bytes(s, 1, tile) for s in shapes)
    assert counted.read + counted.written == want

"""Memory traffic models: what a GPU warp's access pattern moves, what tiling a product
saves, and what naive and tiled attention read and write.

Coalescing. A warp's 32 threads each load one element; the memory system moves whole
32-byte sectors, so the bytes moved are 32 x the sectors the 32 addresses touch and the
efficiency is the bytes asked for over the bytes moved. Thread i reads `elem` bytes at
offset + i x stride x elem. While the gap between one element's end and the next's start
is under a sector, no sector in the span can be skipped, so the span's sectors are all
moved; once the gap is a sector or more, no two threads share one, and each moves the one
or two its element straddles.

Tiled products. C[M, N] = A[M, K] B[K, N] with each output tile (bm x bn) computed from
its row panel of A and column panel of B brought in once (shared memory, or a CPU's cache):
A is read ceil(N / bn) times and B ceil(M / bm) times; without tiles, each output element
reads its whole row and column (2K elements).

Attention. The naive form writes the score matrix S = QK^T (float32) to memory, reads it
back for the softmax, writes P, and reads P for PV; FlashAttention's tiled form keeps S in
tiles on chip, so what moves is Q and O once and K and V once for each query tile that can
see them (the causal mask hides the key tiles above the diagonal). Query heads that share
a KV head (GQA) read its K and V together, as ops/tiled_attention.py does.
"""

from __future__ import annotations

from dataclasses import dataclass

SECTOR = 32
WARP = 32


def _span_sectors(start: int, nbytes: int) -> int:
    return (start + nbytes - 1) // SECTOR - start // SECTOR + 1


def warp_sectors(stride: int, offset: int = 0, elem: int = 4) -> int:
    """Sectors a warp moves reading element i at offset + i * stride * elem (bytes)."""
    if stride < 1 or elem < 1 or offset < 0:
        raise ValueError("stride and elem must be >= 1 and offset >= 0")
    if (stride - 1) * elem < SECTOR:  # gaps under a sector: the whole span moves
        return _span_sectors(offset, (WARP - 1) * stride * elem + elem)
    return sum(_span_sectors(offset + i * stride * elem, elem) for i in range(WARP))


def coalescing_efficiency(stride: int, offset: int = 0, elem: int = 4) -> float:
    """Bytes the warp asked for over the bytes its sectors moved."""
    return WARP * elem / (SECTOR * warp_sectors(stride, offset, elem))


def matmul_bytes(m: int, n: int, k: int, elem: int = 2, tile: tuple[int, int] | None = None) -> int:
    """Bytes read and written by C = A B: tile (bm, bn) brings each panel in once per
    output tile; None: every output element reads its row and column."""
    out = m * n * elem
    if tile is None:
        return 2 * m * n * k * elem + out
    bm, bn = tile
    return (m * k * -(-n // bn) + k * n * -(-m // bm)) * elem + out


@dataclass(frozen=True)
class AttentionShape:
    queries: int  # rows n (the last n of the keys, as a prompt chunk)
    keys: int  # L
    head_dim: int
    heads: int = 1
    kv_heads: int = 1
    elem: int = 4  # bytes of Q, K, V and O
    score_elem: int = 4  # bytes of a score (float32)


def naive_attention_bytes(s: AttentionShape) -> int:
    """Q, K, V read; S written, read and P written (softmax); P read; O written."""
    qo = 2 * s.heads * s.queries * s.head_dim * s.elem
    kv = 2 * s.kv_heads * s.keys * s.head_dim * s.elem
    scores = 4 * s.heads * s.queries * s.keys * s.score_elem
    return qo + kv + scores


def visible_key_tiles(s: AttentionShape, tile_q: int, tile_k: int, causal: bool = True) -> list:
    """For each query tile, the keys of the key tiles some of its rows may see."""
    out = []
    first_row = s.keys - s.queries  # the queries are the last keys
    for i0 in range(0, s.queries, tile_q):
        last = min(s.keys, first_row + min(s.queries, i0 + tile_q)) if causal else s.keys
        out.append(sum(min(tile_k, last - j0) for j0 in range(0, last, tile_k)))
    return out


def tiled_attention_bytes(s: AttentionShape, tile_q: int, tile_k: int, causal: bool = True) -> int:
    """Q read and O written once; each KV head's K and V once per query tile, for the key
    tiles that tile can see."""
    qo = 2 * s.heads * s.queries * s.head_dim * s.elem
    keys = sum(visible_key_tiles(s, tile_q, tile_k, causal))
    return qo + 2 * s.kv_heads * keys * s.head_dim * s.elem

"""The C paged decode attention (kernels/attention.py) against the torch path it replaces."""

from __future__ import annotations

import pytest
import torch

from tokenworks.engine.kv_pool import KVPool
from tokenworks.kernels import attention as kattention
from tokenworks.kernels import build
from tokenworks.kernels.batch import KernelBatch
from tokenworks.ops.attention import AttentionMetadata, attention


def test_the_kernel_builds_here():
    assert build.library() is not None, (
        f"a C compiler (cc) is needed to build kernels/csrc: {build.unavailable()}"
    )


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("window", [None, 7])
@pytest.mark.parametrize("d", [16, 64])  # 64: bfloat16 takes the 16-keys-at-once path
def test_the_kernel_equals_the_torch_path(dtype, window, d):
    if build.library() is None:
        pytest.skip("the C kernel is not built here")
    torch.manual_seed(0)
    n_heads, n_kv, bs = 6, 2, 4
    pool = KVPool(1, 40, bs, n_kv, d, dtype)
    pool.k[0].normal_()
    pool.v[0].normal_()
    lens = [1, 5, 17, 40, 9]  # tokens already cached before this decode step
    perm = torch.randperm(40).tolist()
    tables, used = [], 0
    for n in lens:
        blocks = -(-(n + 1) // bs)
        tables.append(perm[used : used + blocks])
        used = (used + blocks) % 30
    b = len(lens)
    q = torch.randn(b, n_heads, d, dtype=dtype)
    k = torch.randn(b, n_kv, d, dtype=dtype)
    v = torch.randn(b, n_kv, d, dtype=dtype)
    meta = AttentionMetadata.paged([1] * b, lens, tables, bs)
    outs = [attention(q, k, v, meta, pool, 0, d**-0.5, window)]  # torch; writes the new K/V
    batch = KernelBatch.build([1] * b, lens, tables, bs)
    assert batch.decode_only and batch.block_tables.shape[0] == b
    outs.append(kattention.attend(q, batch, pool.k[0], pool.v[0], d**-0.5, window))
    tol = 1e-5 if dtype == torch.float32 else 2e-2
    assert (outs[0].float() - outs[1].float()).abs().max() < tol


def test_an_engine_on_the_kernel_gives_the_tokens_of_the_torch_path(toy_llm):
    from tokenworks import LLM, SamplingParams

    if build.library() is None:
        pytest.skip("the C kernel is not built here")
    prompts = [[5, 6, 7], [9] * 30, list(range(3, 60))]
    params = SamplingParams(max_tokens=10, temperature=0, ignore_eos=True)
    got = {}
    for kernels in ("torch", "c"):
        llm = LLM("toy", dtype="float32", loaded=toy_llm.engine.loaded, kernels=kernels)
        assert (llm.engine.c_kernels is not None) == (kernels == "c")
        got[kernels] = [o.outputs[0].token_ids for o in llm.generate(prompts, params)]
    assert got["torch"] == got["c"]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize(
    ("window", "softcap", "sunk"),
    [(None, None, False), (37, None, False), (100, 25.0, False), (37, None, True)],
)
@pytest.mark.parametrize("tile", [16, 256])
def test_the_online_softmax_kernel_equals_the_float64_definition(
    dtype, window, softcap, sunk, tile
):
    """The C decode kernel's online softmax (csrc attend_online, taken here from context
    1 on) over contexts of 1 to 8,192 keys scattered through the pool: the float64
    attention of the same (stored) keys and values within float32 rounding; GQA, windows,
    soft-capping and gpt-oss's sinks (those on whole score rows too)."""

    if build.library() is None:
        pytest.skip("the C kernel is not built here")
    g = torch.Generator().manual_seed(tile)
    n_heads, n_kv, d, bs = 8, 2, 64, 16
    lens = [1, 15, 300, 8192]
    blocks = [-(-n // bs) for n in lens]
    pool = KVPool(1, sum(blocks), bs, n_kv, d, dtype)
    pool.k[0].copy_(torch.randn(pool.k[0].shape, generator=g))
    pool.v[0].copy_(torch.randn(pool.v[0].shape, generator=g))
    perm = torch.randperm(sum(blocks), generator=g)
    tables = torch.zeros(len(lens), max(blocks), dtype=torch.long)
    at = 0
    for i, nb in enumerate(blocks):
        tables[i, :nb] = perm[at : at + nb]
        at += nb
    q = torch.randn(len(lens), n_heads, d, generator=g).to(dtype)
    sinks = torch.randn(n_heads, generator=g) * 3 if sunk else None
    runs = [(tile, 1), (tile, 0)] if sunk else [(tile, 1)]  # online, and whole rows
    for online in runs:
        got = kattention.paged_decode_attention(
            q, pool.k[0], pool.v[0], tables, torch.tensor(lens), bs, d**-0.5, window, softcap,
            online=online, sinks=sinks,
        )  # fmt: skip
        _check_against_reference(got, q, pool, tables, lens, bs, d, window, softcap, sinks)


def _check_against_reference(got, q, pool, tables, lens, bs, d, window, softcap, sinks):
    from test_tiled_attention import reference

    dtype = q.dtype
    for b, n in enumerate(lens):
        slots = (tables[b, torch.arange(n) // bs] * bs + torch.arange(n) % bs).tolist()
        keys, values = pool.k[0][slots].transpose(0, 1), pool.v[0][slots].transpose(0, 1)
        qb = q[b : b + 1].float()
        want = reference(qb, keys, values, d**-0.5, window, softcap, sinks=sinks)
        if dtype == torch.bfloat16:  # the kernel's query is float32: compare on its output
            want = want.bfloat16().double()
            tol = dict(atol=1e-2, rtol=1e-2)
        else:
            tol = dict(atol=2e-6, rtol=1e-5)
        torch.testing.assert_close(got[b].reshape(1, -1).double(), want, **tol)

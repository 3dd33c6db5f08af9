"""The C paged decode-attention kernel against the pure-torch path it replaces."""

from __future__ import annotations

import os

import pytest
import torch

from tokenworks.engine.kv_cache import KVPool
from tokenworks.ops import paged_kernel
from tokenworks.ops.attention import AttentionMetadata, attention


def test_the_kernel_builds_here():
    if os.environ.get("TOKENWORKS_NO_C_KERNELS"):
        pytest.skip("C kernels disabled by TOKENWORKS_NO_C_KERNELS")
    assert paged_kernel.load() is not None, "a C compiler (cc) is needed to build ops/csrc"


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("window", [None, 7])
@pytest.mark.parametrize("d", [16, 64])  # 64: bfloat16 takes the 16-keys-at-once path
def test_the_kernel_equals_the_torch_path(dtype, window, d):
    if paged_kernel.load() is None:
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
    outs = []
    for kernel in (False, True):
        meta = AttentionMetadata.paged([1] * b, lens, tables, bs, decode_kernel=kernel)
        assert (meta.decode.block_tables is not None) == kernel
        outs.append(attention(q, k, v, meta, pool, 0, d**-0.5, window))
    tol = 1e-5 if dtype == torch.float32 else 2e-2
    assert (outs[0].float() - outs[1].float()).abs().max() < tol


def test_an_engine_on_the_kernel_gives_the_tokens_of_the_torch_path(toy_llm):
    from tokenworks import LLM, SamplingParams

    if paged_kernel.load() is None:
        pytest.skip("the C kernel is not built here")
    prompts = [[5, 6, 7], [9] * 30, list(range(3, 60))]
    params = SamplingParams(max_tokens=10, temperature=0, ignore_eos=True)
    got = {}
    for att in ("sdpa", "cpp"):
        llm = LLM("toy", dtype="float32", loaded=toy_llm.engine.loaded, attention=att)
        assert llm.engine.runner.decode_kernel == (att == "cpp")
        got[att] = [o.outputs[0].token_ids for o in llm.generate(prompts, params)]
    assert got["sdpa"] == got["cpp"]

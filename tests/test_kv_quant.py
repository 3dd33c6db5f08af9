"""The 8-bit KV cache (--kv-cache-dtype int8 / fp8_e4m3): what a vector loses, what
attention loses (within the bound the scales give), and what an engine does with it."""

from __future__ import annotations

import math

import pytest
import torch

from tokenworks import LLM, SamplingParams
from tokenworks.engine.kv_pool import KVPool
from tokenworks.ops.attention import AttentionMetadata, attention

KINDS = ("int8", "fp8_e4m3")


def _pool(kv_dtype: str, blocks: int = 8, heads: int = 2, dim: int = 16) -> KVPool:
    return KVPool(1, blocks, 4, heads, dim, torch.float32, kv_dtype=kv_dtype)


@pytest.mark.parametrize("kind", KINDS)
def test_a_vector_comes_back_within_its_scales_error(kind):
    g = torch.Generator().manual_seed(0)
    x = torch.randn(32, 2, 16, generator=g) * torch.logspace(-3, 2, 32)[:, None, None]
    k = _pool(kind).k[0]
    k.index_copy_(0, torch.arange(32), x)
    back = k.index_select(0, torch.arange(32))
    s = x.abs().amax(-1, keepdim=True) / k.qmax
    err = (back - x).abs()
    if kind == "int8":  # round to nearest: half a step of the vector's scale
        assert (err <= s / 2 * (1 + 1e-5)).all()
    else:  # 3 bits of mantissa; below fp8's normal range, its smallest step
        assert (err <= torch.maximum(x.abs() / 16, s * 2.0**-9) * (1 + 1e-5)).all()
    assert k.data.element_size() == 1 and k.scale.dtype == torch.float32


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("window", [None, 5])
def test_attention_over_an_8_bit_pool_stays_within_the_scales_bound(kind, window):
    """A prompt chunk of 9 then a decode step of 2 sequences over the pool: the output
    moves from the exact pool's by no more than what the scales allow. A key error moves
    each score by at most Δ = scale * sum|q| * max key error, so the softmax weights by a
    factor within exp(±2Δ); a value error moves the output by at most the largest one."""
    g = torch.Generator().manual_seed(1)
    heads, dim, scale = 2, 16, 16**-0.5
    exact, quant = _pool("auto"), _pool(kind)
    tables = [[0, 1, 2], [3, 4, 5]]

    def run(pool, q, k, v, query_lens, context_lens):
        meta = AttentionMetadata.paged(query_lens, context_lens, tables, 4, window=window)
        return attention(q, k, v, meta, pool, 0, scale, window)

    for query_lens, context_lens in (([9, 9], [0, 0]), ([1, 1], [9, 9])):
        n = sum(query_lens)
        q, k, v = (torch.randn(n, heads, dim, generator=g) for _ in range(3))
        want = run(exact, q, k, v, query_lens, context_lens)
        got = run(quant, q, k, v, query_lens, context_lens)
        slots = torch.arange(24)
        k_err = (quant.k[0].index_select(0, slots) - exact.k[0][:24]).abs().max()
        v_err = (quant.v[0].index_select(0, slots) - exact.v[0][:24]).abs().max()
        delta = scale * q.abs().sum(-1).max() * k_err
        bound = (math.exp(2 * delta) - 1) * (exact.v[0][:24].abs().max() + v_err) + v_err
        assert (got - want).abs().max() <= bound * (1 + 1e-4) + 1e-6
        assert (got - want).abs().max() > 0  # the cache really is 8-bit


def test_an_8_bit_pool_holds_about_twice_the_blocks(smol_loaded):
    kw = dict(loaded=smol_loaded, dtype="bfloat16", kv_cache_memory=0.01, warmup=False)
    full = LLM("smollm2-135m", kernels="torch", **kw).engine
    half = LLM("smollm2-135m", kv_cache_dtype="int8", **kw).engine
    # 64-wide heads: 128 bytes in bfloat16, 64 and a 4-byte scale in int8
    assert half.blocks.num_blocks >= 1.8 * full.blocks.num_blocks
    assert half.block_bytes == full.block_bytes * (64 + 4) // 128
    assert half.pool.nbytes == half.blocks.num_blocks * half.block_bytes
    assert half.c_kernels is not None  # the C kernels read and write the 8-bit pool
    assert "int8" in half.describe()


@pytest.mark.parametrize("kind", KINDS)
def test_the_c_kernels_write_the_bytes_torch_writes(kind):
    """tw_rope_store (RoPE at position 0 is the identity) quantises each K and V row to the
    bytes and scale QuantizedKV.quantize gives, over magnitudes from 1e-4 to 1e3."""
    import ctypes

    from tokenworks.kernels import abi, build

    lib = build.library()
    assert lib is not None, build.unavailable()
    torch.manual_seed(0)
    heads, kv_heads, dim, rows = 4, 2, 64, 37
    pool = KVPool(1, 16, 4, kv_heads, dim, torch.float32, kv_dtype=kind)
    qkv = torch.randn(rows, (heads + 2 * kv_heads) * dim) * torch.logspace(-4, 3, rows)[:, None]
    k, v = qkv[:, heads * dim :].reshape(rows, 2, kv_heads, dim).clone().unbind(1)
    dims = abi.Dims(heads * dim, heads, kv_heads, dim, 1, 1, 1e-6, dim**-0.5)
    cos, sin = torch.ones(1, dim), torch.zeros(1, dim)
    positions, slots = torch.zeros(rows, dtype=torch.long), torch.randperm(64)[:rows]
    (kp, vp), (ks, vs) = zip(abi.pool_ptrs(pool.k[0]), abi.pool_ptrs(pool.v[0]), strict=True)
    lib.tw_rope_store(
        ctypes.byref(dims), kp, vp, ks, vs, abi.DTYPE_CODES[pool.k[0].dtype], abi.ptr(qkv),
        abi.F32, abi.ptr(positions), abi.ptr(slots), abi.ptr(cos), abi.ptr(sin), rows, 2,
    )  # fmt: skip
    for layer, x in ((pool.k[0], k), (pool.v[0], v)):
        data, scale = layer.quantize(x)
        assert torch.equal(layer.data[slots], data)
        assert torch.equal(layer.scale[slots], scale)


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("window", [None, 7])
@pytest.mark.parametrize("tile", [None, (16, 1)])  # whole score rows; the online softmax
def test_the_c_decode_attention_reads_an_8_bit_pool_as_torch_does(kind, window, tile):
    """The C paged decode attention over an 8-bit pool, through scattered block tables,
    gives torch's attention over the same pool (both dequantise to float32) within float32
    rounding."""
    from tokenworks.kernels import attention as kattention
    from tokenworks.kernels.batch import KernelBatch

    g = torch.Generator().manual_seed(2)
    heads, kv_heads, dim, bs = 6, 2, 64, 4
    pool = KVPool(1, 40, bs, kv_heads, dim, torch.float32, kv_dtype=kind)
    for layer in (pool.k[0], pool.v[0]):
        layer.index_copy_(0, torch.arange(160), torch.randn(160, kv_heads, dim, generator=g))
    lens = [1, 5, 17, 40, 9]
    perm, tables, used = torch.randperm(40, generator=g).tolist(), [], 0
    for n in lens:
        blocks = -(-(n + 1) // bs)
        tables.append(perm[used : used + blocks])
        used = (used + blocks) % 30
    q, k, v = (torch.randn(len(lens), h, dim, generator=g) for h in (heads, kv_heads, kv_heads))
    meta = AttentionMetadata.paged([1] * len(lens), lens, tables, bs)
    want = attention(q, k, v, meta, pool, 0, dim**-0.5, window)  # writes the new K/V
    batch = KernelBatch.build([1] * len(lens), lens, tables, bs)
    got = kattention.paged_decode_attention(
        q, pool.k[0], pool.v[0], batch.block_tables, batch.context_lens, bs, dim**-0.5, window,
        online=tile,
    )  # fmt: skip
    torch.testing.assert_close(got.reshape(want.shape), want, atol=2e-6, rtol=1e-5)


SYSTEM = "You are a helpful assistant. You answer briefly, and you say so when unsure. "
PROMPTS = [SYSTEM + p for p in ["The capital of France is", "def fibonacci(n):",
           "Once upon a time, there", "The three primary colours are", "import numpy as np",
           "Water boils at", "In 1969, the first", "My favourite fruit is"]]  # fmt: skip
GREEDY = SamplingParams(max_tokens=16, temperature=0, ignore_eos=True)


def _top1(llm: LLM, sequences: list[list[int]], last: int) -> list[int]:
    """The engine's most likely token at each of the last `last` positions of each
    sequence, given the tokens before it (the prompt pass's logprobs)."""
    outs = llm.generate(sequences, SamplingParams(max_tokens=1, prompt_logprobs=1),
                        use_tqdm=False)  # fmt: skip
    return [lp.top[0][0] for o in outs for lp in o.prompt_logprobs[-last:]]


def _agreement(name: str, loaded, prompts: list[str], kernels: str) -> float:
    """Greedy continuations from the bfloat16 cache; then, along them, the share of
    positions whose most likely token the int8 cache picks as the bfloat16 cache does
    (a near-tie that flips one token would otherwise make every later one differ)."""
    kw = dict(loaded=loaded, dtype="bfloat16", kernels=kernels, warmup=False)
    ref = LLM(name, **kw)
    seqs = [o.prompt_token_ids + o.outputs[0].token_ids for o in ref.generate(prompts, GREEDY)]
    want = _top1(ref, seqs, GREEDY.max_tokens)
    got = _top1(LLM(name, kv_cache_dtype="int8", **kw), seqs, GREEDY.max_tokens)
    return sum(a == b for a, b in zip(want, got, strict=True)) / len(want)


@pytest.mark.parametrize(
    ("kernels", "exact"),
    # the torch path in float32, as tests/test_batching.py checks hits against misses (in
    # bfloat16 it is not batch-invariant: a prompt's tail alone may round otherwise); the
    # C kernels in bfloat16, batch-invariant
    [("torch", dict(dtype="float32", quantization="none")), ("c", dict(dtype="bfloat16"))],
)
def test_greedy_tokens_with_an_int8_cache_agree_with_bfloat16(smol_loaded, kernels, exact):
    """At least 90% of the greedy tokens agree (SmolLM2 has near-ties: its bfloat16 and
    float32 caches agree on 94% of these); and on the int8 cache itself, prefix hits and
    n = 2 (copy-on-write of the shared last block) give its tokens again."""
    assert _agreement("smollm2-135m", smol_loaded, PROMPTS, kernels) >= 0.9
    llm = LLM("smollm2-135m", loaded=smol_loaded, kernels=kernels, kv_cache_dtype="int8",
              warmup=False, **exact)  # fmt: skip
    got = [o.outputs[0].token_ids for o in llm.generate(PROMPTS, GREEDY)]
    again = llm.generate(PROMPTS, GREEDY)  # every prompt's full blocks now cached
    assert [o.outputs[0].token_ids for o in again] == got
    assert all(o.num_cached_tokens >= 16 for o in again)
    pair = llm.generate([PROMPTS[0]], SamplingParams(max_tokens=16, n=2, temperature=0,
                                                      ignore_eos=True))  # fmt: skip
    assert [c.token_ids for c in pair[0].outputs] == [got[0], got[0]]


def test_an_int8_cache_decodes_on_the_c_kernels_as_it_prefills(smol_loaded):
    """Without batch invariance the C kernels take bigger batches apart: prompt chunks
    stored by tw_rope_store and attended in torch, decode batches of more than MAX_ROWS
    stored and attended by tw_rope_attend. Over the same int8 cache the two agree: the
    tokens a 12-sequence decode picked are the prompt pass's most likely tokens along the
    same text at 90% of positions or more."""
    from tokenworks.kernels.forward import MAX_ROWS

    llm = LLM("smollm2-135m", loaded=smol_loaded, dtype="bfloat16", kv_cache_dtype="int8",
              kernels="c", batch_invariant=False, warmup=False)  # fmt: skip
    assert not llm.engine.c_kernels.invariant
    prompts = PROMPTS + PROMPTS[:4]
    assert len(prompts) > MAX_ROWS
    outs = llm.generate(prompts, GREEDY, use_tqdm=False)
    decoded = [t for o in outs for t in o.outputs[0].token_ids]
    seqs = [o.prompt_token_ids + o.outputs[0].token_ids for o in outs]
    prefilled = _top1(llm, seqs, GREEDY.max_tokens)
    assert sum(a == b for a, b in zip(decoded, prefilled, strict=True)) >= 0.9 * len(decoded)


def test_a_windowed_model_runs_on_an_int8_cache(gemma3_loaded):
    """Gemma 3's six layer groups (five of 512-token windows) keep their blocks in int8
    too, on the C kernels, and its greedy tokens agree with its bfloat16 cache's."""
    assert _agreement("gemma3-270m", gemma3_loaded, PROMPTS[:4], "c") >= 0.9


def test_perplexity_with_an_int8_cache_is_within_one_percent(smol_loaded, tmp_path, capsys):
    import json
    from pathlib import Path

    from tokenworks.cli import main

    text = Path(__file__).parent / "data" / "held_out.txt"
    found = {}
    for kind in ("auto", "int8"):
        argv = ["eval", "perplexity", str(text), "--context", "128", "--max-tokens", "384",
                "--kernels", "torch", "--kv-cache-dtype", kind, "--json",
                "--out", str(tmp_path)]  # fmt: skip
        assert main(argv) == 0
        found[kind] = json.loads(capsys.readouterr().out.strip().splitlines()[-1])["perplexity"]
    assert found["int8"] != found["auto"]
    assert abs(found["int8"] / found["auto"] - 1) < 0.01, found


def test_what_an_8_bit_cache_does_not_go_with_is_refused():
    from tokenworks.config import EngineConfig

    for kw, says in [
        ({"kv_cache_dtype": "int4"}, "expected one of auto, int8, fp8_e4m3"),
        ({"kv_cache_dtype": "int8", "compile": True}, "compile does not go with it"),
    ]:
        with pytest.raises(ValueError, match=says):
            EngineConfig(model="toy", **kw)

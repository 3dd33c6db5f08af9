"""Every C kernel entry point on shapes drawn by hypothesis, against torch: no rows, one row,
rows past every tile (32) and vector block (8), prompt chunks at any offset, batches in
which no row samples; on every path this CPU has (packed products on AMX tiles and as
AVX-512 BF16 dot products, the dot-product decode step, the prompt-chunk attention, and
torch's products where the packed ones are off)."""

from __future__ import annotations

import dataclasses

import pytest
import torch
import torch.nn.functional as F
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from tokenworks.engine.kv_pool import KVPool
from tokenworks.kernels import abi, build, products
from tokenworks.kernels import attention as kattention
from tokenworks.kernels.batch import KernelBatch
from tokenworks.kernels.forward import LlamaForward
from tokenworks.models import build_model
from tokenworks.models.toy import toy_spec, toy_weights
from tokenworks.ops.attention import AttentionMetadata, attention, sequence_attention

pytestmark = pytest.mark.skipif(
    build.library() is None, reason="the C kernels cannot be built here"
)

# the same examples on every run (a failure reproduces), and fixtures that hold per test
SHAPES = settings(
    max_examples=25,
    deadline=None,
    derandomize=True,
    suppress_health_check=[HealthCheck.function_scoped_fixture],
)
# counts at and around every block boundary the kernels have, and some between
ROWS = st.one_of(
    st.sampled_from([0, 1, 2, 7, 8, 9, 15, 16, 17, 31, 32, 33, 63, 64, 65, 256, 257]),
    st.integers(0, 300),
)


@SHAPES
@given(
    rows=ROWS,
    n=st.integers(1, 8).map(lambda p: 32 * p),
    k=st.integers(1, 8).map(lambda s: 32 * s),
    with_bias=st.booleans(),
    glu=st.booleans(),
)
def test_packed_products_take_any_number_of_rows(packed_products, rows, n, k, with_bias, glu):
    """The packed product (and its SwiGLU form) of any number of rows, none included, is
    as close to the float64 product as torch's bfloat16 product is."""
    if packed_products is None:
        pytest.skip("no packed products on this CPU (AMX or AVX-512 BF16)")
    g = torch.Generator().manual_seed(rows * 1000 + n + k)
    w = torch.randn(n, k, generator=g).bfloat16()
    bias = torch.randn(n, generator=g).bfloat16() if with_bias else None
    x = torch.randn(rows, k, generator=g).bfloat16()
    got = products.packed_product(w, bias, glu=glu)(x)
    exact = x.double() @ w.double().t() + (0 if bias is None else bias.double())
    theirs = F.linear(x, w, bias).double()
    if glu:
        half = n // 2
        exact = F.silu(exact[:, :half]) * exact[:, half:]
        theirs = F.silu(theirs[:, :half]) * theirs[:, half:]
    assert got.shape == exact.shape and got.dtype == torch.bfloat16
    if rows:
        ours_err = (got.double() - exact).abs().max().item()
        theirs_err = (theirs - exact).abs().max().item()
        assert ours_err <= 1.5 * theirs_err + 1e-6, (ours_err, theirs_err)


def _scattered_tables(lens: list[int], block_size: int) -> tuple[list[list[int]], int]:
    """Block tables for sequences of these context lengths (each with room for its next
    token), their blocks drawn in a random order from one pool; and the pool's blocks."""
    blocks_each = [-(-(n + 1) // block_size) for n in lens]
    num_blocks = max(1, sum(blocks_each))
    perm = torch.randperm(num_blocks).tolist()
    tables, used = [], 0
    for need in blocks_each:
        tables.append(perm[used : used + need])
        used += need
    return tables, num_blocks


@SHAPES
@given(
    lens=st.lists(st.integers(0, 90), min_size=0, max_size=12),
    block_size=st.sampled_from([1, 4, 16]),
    dtype=st.sampled_from([torch.float32, torch.bfloat16]),
    d=st.sampled_from([16, 64]),
    window=st.one_of(st.none(), st.integers(1, 40)),
)
def test_paged_decode_attention_takes_any_contexts(lens, block_size, dtype, d, window):
    """Decode attention through the block tables (C) against the gathered torch path, for
    any number of sequences (none included) and any context lengths."""
    torch.manual_seed(len(lens) * 100 + block_size)
    n_heads, n_kv = 6, 2
    tables, num_blocks = _scattered_tables(lens, block_size)
    pool = KVPool(1, num_blocks, block_size, n_kv, d, dtype)
    pool.k[0].normal_()
    pool.v[0].normal_()
    b = len(lens)
    q, k, v = (torch.randn(b, h, d, dtype=dtype) for h in (n_heads, n_kv, n_kv))
    meta = AttentionMetadata.paged([1] * b, lens, tables, block_size)
    outs = [attention(q, k, v, meta, pool, 0, d**-0.5, window)]  # torch; writes the new K/V
    batch = KernelBatch.build([1] * b, lens, tables, block_size)
    outs.append(kattention.attend(q, batch, pool.k[0], pool.v[0], d**-0.5, window))
    assert outs[0].shape == outs[1].shape == (b, n_heads * d)
    tol = 1e-5 if dtype == torch.float32 else 2e-2
    if b:
        assert (outs[0].float() - outs[1].float()).abs().max().item() <= tol


@SHAPES
@given(
    lens=st.lists(st.integers(0, 90), min_size=0, max_size=6),
    block_size=st.sampled_from([1, 4, 16]),
    dtype=st.sampled_from([torch.float32, torch.bfloat16]),
)
def test_latent_decode_attention_takes_any_contexts(lens, block_size, dtype):
    """Latent attention's absorbed decode in C (rows of latent + RoPE key, read once for
    keys and values, in tiles of 32) against the module's torch form over the same pool,
    for any number of sequences and any context lengths."""
    from tokenworks.models.mla import LatentAttention
    from tokenworks.models.spec import MLASpec

    torch.manual_seed(len(lens) * 100 + block_size)
    mla = MLASpec(kv_lora_rank=32, q_lora_rank=0, qk_nope_head_dim=16, qk_rope_head_dim=8,
                  v_head_dim=16)  # fmt: skip
    spec = dataclasses.replace(toy_spec(), n_heads=4, n_kv_heads=4, head_dim=24, mla=mla)
    module = LatentAttention(spec, 0)
    module.kv_b.normal_()
    module = module.to(dtype)
    tables, num_blocks = _scattered_tables(lens, block_size)
    pool = KVPool.for_spec(spec, num_blocks, block_size, dtype)
    pool.k[0].normal_()
    b = len(lens)
    q = torch.randn(b, 4, module.dq, dtype=dtype)
    meta = AttentionMetadata.paged([1] * b, lens, tables, block_size)
    batch = KernelBatch.build([1] * b, lens, tables, block_size)
    got = kattention.latent_decode_attention(
        module.latent_query(q), pool.k[0], batch.block_tables, batch.context_lens, block_size,
        module.scale, 32,
    )  # fmt: skip
    assert got.shape == (b, 4, 32)
    if b:
        want = module._absorbed(q, pool.k[0], meta.decode)
        tol = 1e-4 if dtype == torch.float32 else 5e-2
        diff = module.latent_output(got.to(dtype)).float() - want.float()
        assert diff.abs().max().item() <= tol * want.abs().max().item()


@pytest.fixture(params=["amx", "vector"])
def prefill_path(request) -> bool:
    if not kattention.prefill_available():
        pytest.skip("neither AMX nor AVX-512 BF16 on this CPU")
    if request.param == "amx" and not products.tiles_granted():
        pytest.skip("no AMX tiles on this CPU")
    return request.param == "amx"


@SHAPES
@given(chunks=st.lists(st.tuples(st.integers(0, 300), ROWS.filter(bool)), max_size=5))
def test_prompt_attention_takes_chunks_at_any_offset(prefill_path, chunks):
    """Causal attention of prompt chunks (C) against torch's attention of each sequence,
    for chunks of any length starting at any position of their prompt."""
    h, kvh, d = 9, 3, 64
    torch.manual_seed(len(chunks))
    slots_needed = sum(c + n for c, n in chunks) + 1
    k_pool, v_pool = (torch.randn(slots_needed, kvh, d).bfloat16() for _ in range(2))
    perm = torch.randperm(slots_needed)
    q = torch.randn(sum(n for _, n in chunks), h, d).bfloat16()
    seqs, start, used = [], 0, 0
    for ctx, n in chunks:
        seqs.append((start, n, perm[used : used + ctx + n]))
        start, used = start + n, used + ctx + n
    out = torch.full((q.shape[0], h * d), float("nan"), dtype=torch.bfloat16)
    done = kattention.prefill_attention(q, k_pool, v_pool, seqs, d**-0.5, out, amx=prefill_path)
    assert done == bool(chunks)  # nothing to attend: torch's path (which does nothing)
    for start, n, index in seqs:
        kt, vt = k_pool[index].transpose(0, 1), v_pool[index].transpose(0, 1)
        want = sequence_attention(q[start : start + n], kt, vt, d**-0.5, None)
        torch.testing.assert_close(out[start : start + n], want, atol=3e-2, rtol=3e-2)


def test_empty_calls_into_every_entry_point_return_at_once():
    """Each C entry point handed zero rows (or sequences) writes nothing and returns; none
    divides by its row count."""
    lib = build.library()
    nothing = torch.empty(0)
    p = nothing.data_ptr()
    if products.packed_built():
        assert lib.tw_packed_linear(p, 0, 64, p, 64, None, p, abi.BF16, 2) == 0
    tables, lens = torch.zeros(0, 1, dtype=torch.long), torch.zeros(0, dtype=torch.long)
    kv = abi.kv_view(tables, lens, 16, None, abi.F32, nothing, nothing)
    lib.tw_paged_attention(kv, p, p, 0, 6, 2, 64, 0.125, 2)
    lib.tw_latent_attention(kv, p, p, 0, 16, 576, 512, 0.125, 2)
    lib.tw_argmax_rows(p, abi.F32, 0, 10, p, 2)
    lib.tw_swiglu(p, p, abi.F32, 0, 64, 2)
    lib.tw_residual_norm(p, None, abi.F32, p, 1e-5, p, abi.F32, 0, 64, 2)
    if kattention.prefill_available():
        q = torch.empty(0, 9, 64, dtype=torch.bfloat16)
        out = torch.empty(0, 576, dtype=torch.bfloat16)
        assert not kattention.prefill_attention(q, q, q, [], 0.125, out)


# ------------------------------------------------------------------ whole forward passes

AMX_SHAPES = {"n_heads": 6, "n_kv_heads": 2, "head_dim": 64, "vocab_size": 320}


@pytest.fixture(params=["default", "vector", "unpacked", "dot"])
def step_path(request, monkeypatch):
    """How the kernel's batches multiply: as this CPU does by default (tiles or vector
    products where packed products run), the packed vector products on a CPU with tiles,
    torch's products with the packed ones off, and the dot-product whole step alone."""
    if request.param == "vector":
        if not products.tiles_granted():
            pytest.skip("the default already ran the vector products, or none run here")
        with products.vector_products():
            yield request.param
        return
    if request.param == "unpacked":
        if not products.packed_built():
            pytest.skip("the default already ran without packed products")
        monkeypatch.setattr(products, "packed_built", lambda: False)
    yield request.param


def _bf16_model(spec):
    model = build_model(spec, toy_weights(spec, seed=3), torch.bfloat16)
    return model


@settings(
    max_examples=12,
    deadline=None,
    derandomize=True,
    suppress_health_check=[HealthCheck.function_scoped_fixture],
)
@given(
    seqs=st.lists(
        st.tuples(st.integers(0, 70), st.integers(1, 80), st.booleans()), min_size=1, max_size=6
    ),
    decodes=st.integers(0, 40),
)
def test_any_batch_through_the_kernels_equals_the_modules(step_path, seqs, decodes):
    """A flat batch of prompt chunks (any offset, sampling or not) and decode tokens, or
    decode tokens alone, through the C kernels gives the logits of the torch modules on the
    same bfloat16 weights, for the rows that sample: none, when every chunk is mid-prompt."""
    spec = dataclasses.replace(toy_spec(), **AMX_SHAPES)
    model = _bf16_model(spec)
    bs = 4
    items = [(c, n, s) for c, n, s in seqs] + [(c, 1, True) for c in range(3, 3 + decodes)]
    if step_path == "dot":  # decode tokens only, few enough for the dot-product whole step
        items = [(c, 1, True) for c, _, _ in items[:8]]
    need = [-(-(c + n) // bs) for c, n, _ in items]
    pool = KVPool(spec.n_layers, sum(need), bs, spec.n_kv_heads, spec.head_dim, torch.bfloat16)
    g = torch.Generator().manual_seed(5)
    for t in pool.k + pool.v:
        t.copy_(torch.randn(t.shape, generator=g))
    perm = torch.randperm(sum(need), generator=g).tolist()
    tables, used = [], 0
    for n in need:
        tables.append(perm[used : used + n])
        used += n
    q_lens, ctx_lens = [n for _, n, _ in items], [c for c, _, _ in items]
    ids = torch.randint(0, spec.vocab_size, (sum(q_lens),), generator=g)
    pos = torch.cat([torch.arange(c, c + n) for c, n, _ in items])
    ends = torch.cumsum(torch.tensor(q_lens), 0) - 1
    rows = ends[torch.tensor([s for _, _, s in items])]
    out = {}
    for fused in (False, True):
        before = [t.clone() for t in pool.k + pool.v]
        with torch.inference_mode():
            if fused:
                kernel = LlamaForward.prepare(model, pool, packed=step_path != "unpacked")
                if step_path == "dot":
                    kernel.amx = None  # the dot-product whole step for every decode batch
                batch = KernelBatch.build(q_lens, ctx_lens, tables, bs)
                assert kernel.accepts(batch.query_lens)
                if step_path == "dot":
                    assert kernel._whole_step(batch.query_lens)
                out[fused], _ = kernel.run(ids, pos, [batch], rows)
            else:
                meta = AttentionMetadata.paged(q_lens, ctx_lens, tables, bs)
                out[fused] = model(ids, pos, meta, pool, logits_rows=rows)
        for t, kept in zip(pool.k + pool.v, before, strict=True):
            t.copy_(kept)  # each run writes its own new K/V: start both from the same pool
    assert out[True].shape == out[False].shape == (rows.numel(), spec.vocab_size)
    if rows.numel():
        scale = max(1.0, out[False].abs().max().item())
        assert (out[True].float() - out[False].float()).abs().max().item() < 0.1 * scale

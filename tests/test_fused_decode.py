"""The C forward paths (kernels/forward.py) against the torch modules they replace."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from tokenworks.engine.kv_pool import KVPool
from tokenworks.kernels import abi, build, products
from tokenworks.kernels.batch import KernelBatch
from tokenworks.kernels.forward import MAX_ROWS, LlamaForward
from tokenworks.kernels.products import PACK_MAX, product
from tokenworks.models import build_model
from tokenworks.models.toy import toy_spec, toy_weights
from tokenworks.ops.attention import AttentionMetadata

pytestmark = pytest.mark.skipif(
    build.library() is None, reason="the C kernels cannot be built here"
)

VARIANTS = {
    "gqa": {},
    "qkv-bias": {"qkv_bias": True},
    "sliding-window": {"sliding_window": 5},
    "mqa": {"n_kv_heads": 1},
    # SmolLM2's attention shape (head_dim 64, 3 query heads a KV head: the vector paths)
    "head-dim-64": {"n_heads": 6, "n_kv_heads": 2, "head_dim": 64},
    # widths that are no multiple of 16: the scalar tails of the norm and SwiGLU
    "odd-widths": {"hidden_size": 72, "intermediate_size": 136},
    # every product a multiple of 32 wide: on AMX CPUs the whole step runs on tiles
    "amx-shapes": {"n_heads": 6, "n_kv_heads": 2, "head_dim": 64, "vocab_size": 320},
    # Qwen3's per-head Q/K norms
    "qwen3": {"arch": "qwen3", "qk_norm": True},
    # Gemma 2's soft-capped attention scores and logits (and its sandwich norms, GeGLU)
    "gemma2": {
        "arch": "gemma2", "sandwich_norms": True, "mlp_act": "gelu_tanh", "embed_scale": 4.0,
        "attn_scale": 0.2, "attn_softcap": 2.0, "final_softcap": 1.5,
    },
    # Gemma 3's layer: Q/K norms, the sublayers' outputs normed, GeGLU, a scaled embedding
    # and its own attention scale (its windows over grouped pools: test_gemma3.py)
    "gemma3": {
        "arch": "gemma3", "qk_norm": True, "sandwich_norms": True, "mlp_act": "gelu_tanh",
        "embed_scale": 4.0, "attn_scale": 0.2,
    },
}  # fmt: skip


def _weights(spec):
    w = toy_weights(spec, seed=3)
    g = torch.Generator().manual_seed(6)
    for i in range(spec.n_layers):
        p = f"model.layers.{i}."
        names = ["self_attn.q_norm", "self_attn.k_norm"] if spec.qk_norm else []
        names += ["attn_output_norm", "mlp_output_norm"] if spec.sandwich_norms else []
        for n in names:
            size = spec.head_dim if "_norm" in n and "self_attn" in n else spec.hidden_size
            w[p + n + ".weight"] = 1 + torch.randn(size, generator=g) * 0.1
    if spec.qkv_bias:
        g = torch.Generator().manual_seed(4)
        for i in range(spec.n_layers):
            for n, size in (("q", spec.q_size), ("k", spec.kv_size), ("v", spec.kv_size)):
                w[f"model.layers.{i}.self_attn.{n}_proj.bias"] = torch.randn(size, generator=g)
    return w


def _decode_step(model, pool, ctx_lens, fused: bool, greedy: bool = False):
    """One decode token for each sequence (contexts already in the pool) -> logits (greedy:
    what the model returns when only the argmax is wanted)."""
    torch.manual_seed(7)
    bs = pool.block_size
    tables, start = [], 0
    for n in ctx_lens:  # blocks handed out in a scrambled order
        need = -(-(n + 1) // bs)
        tables.append([(start + j) * 7 % pool.num_blocks for j in range(need)])
        start += need
    b = len(ctx_lens)
    ids = torch.randint(0, model.spec.vocab_size, (b,))
    pos = torch.tensor(ctx_lens)
    with torch.inference_mode():
        if not fused:
            return model(ids, pos, AttentionMetadata.paged([1] * b, ctx_lens, tables, bs), pool)
        batch = KernelBatch.build([1] * b, ctx_lens, tables, bs)
        assert model.c_forward.accepts(batch.query_lens)
        logits, choices = model.c_forward.run(ids, pos, [batch], greedy=greedy)
        return choices if greedy else logits


def _blocks(weights: dict) -> dict:
    """The matrices as GGUF Q8_0 blocks (what a file would hold), the rest as they are."""
    import gguf

    from tokenworks.kernels.blocks import from_array

    out = {}
    for name, t in weights.items():
        if t.dim() == 2 and t.shape[1] % 32 == 0:
            q = gguf.quants.quantize(t.numpy(), gguf.GGMLQuantizationType.Q8_0)
            out[name] = from_array(8, tuple(t.shape), q)
        else:
            out[name] = t
    return out


def _model_and_pool(spec, dtype, quantization=None):
    weights = _blocks(_weights(spec)) if quantization == "gguf" else _weights(spec)
    model = build_model(spec, weights, dtype, quantization=quantization)
    pool = KVPool(spec.n_layers, 64, 4, spec.n_kv_heads, spec.head_dim, dtype)
    g = torch.Generator().manual_seed(5)
    for t in pool.k + pool.v:
        t.copy_(torch.randn(t.shape, generator=g))
    return model, pool


@pytest.mark.parametrize("variant", VARIANTS)
@pytest.mark.parametrize(
    "quantization, max_rows",
    # max_rows 0: run_batched (dense weights, or blocks)
    [(None, 8), (None, 0), ("int8", 8), ("gguf", 8), ("gguf", 0)],
)
def test_float32_fused_step_equals_the_modules(variant, quantization, max_rows):
    spec = dataclasses.replace(toy_spec(), **VARIANTS[variant])
    model, pool = _model_and_pool(spec, torch.float32, quantization)
    ctx_lens = [0, 3, 17, 40, 9]
    want = _decode_step(model, pool, ctx_lens, fused=False)
    model.c_forward = LlamaForward.prepare(model, pool, max_rows=max_rows)
    assert model.c_forward is not None
    got = _decode_step(model, pool, ctx_lens, fused=True)
    assert got.shape == want.shape
    assert (got - want).abs().max() < 1e-4 * max(1.0, want.abs().max().item())


def _moe_weights(spec) -> dict:
    """_weights with each layer's MLP a mixture: a router, experts and a gated shared one."""
    w, m = _weights(spec), spec.moe
    g = torch.Generator().manual_seed(8)
    h = spec.hidden_size
    for i in range(spec.n_layers):
        p = f"model.layers.{i}.mlp."
        for n in ("gate_proj", "up_proj", "down_proj"):
            del w[p + n + ".weight"]
        w[p + "gate.weight"] = torch.randn(m.n_experts, h, generator=g)
        w[p + "shared_expert_gate.weight"] = torch.randn(1, h, generator=g) * 0.2
        for x, inter in [(f"experts.{j}.", m.intermediate) for j in range(m.n_experts)] + [
            ("shared_experts.", m.shared_intermediate)
        ]:
            w[p + x + "gate_proj.weight"] = torch.randn(inter, h, generator=g) * 0.2
            w[p + x + "up_proj.weight"] = torch.randn(inter, h, generator=g) * 0.2
            w[p + x + "down_proj.weight"] = torch.randn(h, inter, generator=g) * 0.2
    return w


@pytest.mark.parametrize("quantization", [None, "gguf"])
def test_moe_layers_run_batched_with_their_experts_as_stored(quantization):
    """A Qwen2-MoE-shaped model takes the C forward (its experts, routed in torch, between
    the C calls: run_batched for every batch) and equals the modules, decode and prompt
    chunks; a GGUF's quantised experts stay the file's blocks, never a float copy."""
    from tokenworks.models.spec import MoESpec

    moe = MoESpec(n_experts=4, top_k=2, intermediate=32, shared_intermediate=64, shared_gate=True)
    spec = dataclasses.replace(toy_spec(), arch="qwen2_moe", moe=moe)
    weights = _moe_weights(spec)
    model = build_model(spec, _blocks(weights) if quantization else weights, torch.float32,
                        quantization=quantization)  # fmt: skip
    layer = model.moe_layers()[0]
    assert (layer.blocks is not None) == (quantization == "gguf")
    assert (layer.gate_up is None) == (quantization == "gguf")
    pool = KVPool(spec.n_layers, 64, 4, spec.n_kv_heads, spec.head_dim, torch.float32)
    g = torch.Generator().manual_seed(5)
    for t in pool.k + pool.v:
        t.copy_(torch.randn(t.shape, generator=g))
    model.c_forward = LlamaForward.prepare(model, pool)
    assert model.c_forward is not None and model.c_forward.max_rows == 0
    ctx_lens = [0, 3, 17, 40, 9]
    want = _decode_step(model, pool, ctx_lens, fused=False)
    got = _decode_step(model, pool, ctx_lens, fused=True)
    assert (got - want).abs().max() < 1e-4 * max(1.0, want.abs().max().item())
    q_lens, ctx_lens = [5, 1, 3], [0, 7, 2]  # prompt chunks and a decode
    tables = [[0, 1], [2, 3], [4, 5]]
    ids = torch.randint(0, spec.vocab_size, (9,), generator=torch.Generator().manual_seed(1))
    pos = torch.cat([torch.arange(c, c + n) for n, c in zip(q_lens, ctx_lens, strict=True)])
    with torch.inference_mode():
        want = model(ids, pos, AttentionMetadata.paged(q_lens, ctx_lens, tables, 4), pool)
        batch = KernelBatch.build(q_lens, ctx_lens, tables, 4)
        got, _ = model.c_forward.run(ids, pos, [batch])
    assert (got - want).abs().max() < 1e-4 * max(1.0, want.abs().max().item())


@pytest.mark.parametrize("variant", ["gqa", "head-dim-64", "amx-shapes"])
@pytest.mark.parametrize("max_rows", [8, 0])
def test_bfloat16_fused_step_is_at_least_as_close_to_float32_as_the_modules(
    max_rows, variant, packed_products
):
    """Activations stay float32 in the kernel, so its error comes from the weights alone
    (run_batched: the products' inputs are bfloat16, as in torch, the rest float32): on
    average over the logits it is no bigger than torch's bfloat16 modules', and its worst
    logit within half as much again (which logit rounds worst varies from path to path)."""
    spec = dataclasses.replace(toy_spec(), **VARIANTS[variant])
    ref_model, ref_pool = _model_and_pool(spec, torch.float32)
    model, pool = _model_and_pool(spec, torch.bfloat16)
    for a, b in zip(ref_pool.k + ref_pool.v, pool.k + pool.v, strict=True):
        a.copy_(b.float())  # the same (bfloat16-representable) context in both pools
    ctx_lens = [2, 30, 11, 7, 19, 0]  # more than DOT_ROWS: AMX tiles where they run
    ref = _decode_step(ref_model, ref_pool, ctx_lens, fused=False)
    torch_err = (_decode_step(model, pool, ctx_lens, fused=False) - ref).abs()
    model.c_forward = LlamaForward.prepare(model, pool, max_rows=max_rows)
    fused_err = (_decode_step(model, pool, ctx_lens, fused=True) - ref).abs()
    assert fused_err.mean() <= torch_err.mean(), (fused_err.mean(), torch_err.mean())
    assert fused_err.max() <= torch_err.max() * 1.5, (fused_err.max(), torch_err.max())


def test_which_batches_the_kernel_takes():
    spec = toy_spec()
    model, pool = _model_and_pool(spec, torch.float32)
    kernel = LlamaForward.prepare(model, pool, max_rows=2)
    tables = [[0, 1], [2, 3], [4, 5]]
    decode3 = KernelBatch.build([1] * 3, [3, 3, 3], tables, 4)
    decode2 = KernelBatch.build([1] * 2, [3, 3], tables[:2], 4)
    mixed = KernelBatch.build([4, 1], [0, 3], tables[:2], 4)
    assert decode2.decode_only and not mixed.decode_only and len(mixed.chunks) == 1
    assert kernel.accepts(decode2.query_lens) and kernel._whole_step(decode2.query_lens)
    assert kernel.accepts(decode3.query_lens)  # beyond max_rows: run_batched (dense weights)
    assert not kernel._whole_step(decode3.query_lens)
    # prefill in the batch: run_batched
    assert kernel.accepts(mixed.query_lens) and not kernel._whole_step(mixed.query_lens)
    int8, pool8 = _model_and_pool(spec, torch.float32, "int8")
    kernel8 = LlamaForward.prepare(int8, pool8, max_rows=2)
    assert kernel8.accepts(decode2.query_lens)
    assert not kernel8.accepts(decode3.query_lens)  # int8 without a dense copy: the modules
    assert not kernel8.accepts(mixed.query_lens)


def test_amx_takes_the_whole_step_for_bigger_decode_batches():
    """Packed weights (AMX tiles, or AVX-512 BF16 dot products without them) take the
    whole step of bigger decode batches."""
    spec = dataclasses.replace(toy_spec(), **VARIANTS["amx-shapes"])
    model, pool = _model_and_pool(spec, torch.bfloat16)
    kernel = LlamaForward.prepare(model, pool)
    if not products.packed_built():
        assert kernel.amx is None and kernel.max_rows == MAX_ROWS
        pytest.skip("no packed products on this CPU (AMX or AVX-512 BF16)")
    assert kernel.amx is not None and kernel.max_rows == PACK_MAX
    layers, model_c = kernel.amx
    assert model_c.head.dtype == abi.PACKED and layers[0].down.dtype == abi.PACKED
    assert kernel.layers_c[0].down.dtype == abi.BF16  # small batches: dot products
    tables = [[i] for i in range(40)]
    assert kernel._whole_step(KernelBatch.build([1] * 40, [2] * 40, tables, 4).query_lens)
    toy = toy_spec()  # a vocabulary no multiple of 32: no AMX head, so no AMX whole step
    model2, pool2 = _model_and_pool(toy, torch.bfloat16)
    kernel2 = LlamaForward.prepare(model2, pool2)
    assert kernel2.amx is None and kernel2.max_rows == MAX_ROWS and kernel2.packs


def test_prefill_sized_products_are_packed_only_without_tiles(packed_products, monkeypatch):
    """More than PACK_MAX rows (a prefill chunk) multiply the packed weights where the
    packed products are vector dot products, and torch's product where they run on AMX
    tiles; both give the product."""
    if packed_products is None:
        pytest.skip("no packed products on this CPU (AMX or AVX-512 BF16)")
    lib, rows_seen = build.library(), []
    real = lib.tw_packed_linear
    monkeypatch.setattr(lib, "tw_packed_linear", lambda *a: rows_seen.append(a[1]) or real(*a))
    g = torch.Generator().manual_seed(0)
    w = torch.randn(96, 160, generator=g).bfloat16()
    run = product(w, None, products.pack_weight(w))
    x = torch.randn(PACK_MAX + 44, 160, generator=g).bfloat16()
    torch.testing.assert_close(run(x), torch.nn.functional.linear(x, w))
    assert rows_seen == ([] if packed_products == "tiles" else [PACK_MAX + 44])
    run(x[:64])
    assert rows_seen[-1] == 64  # up to PACK_MAX rows: packed either way


@pytest.mark.parametrize(
    "nan_columns",
    [(), (250,), (5, 250)],  # none; in the second thread's panels only; in both
)
def test_greedy_amx_steps_return_the_argmax_of_their_logits(nan_columns, packed_products):
    """A greedy whole step on packed weights keeps each row's argmax in the head and
    writes no logits: its choices are torch.argmax's of the logits the same step writes
    otherwise, ties (the same weights in both threads' panels) and NaN (the first wins)
    included."""
    if packed_products is None:
        pytest.skip("no packed products on this CPU (AMX or AVX-512 BF16)")
    spec = dataclasses.replace(toy_spec(), **VARIANTS["amx-shapes"])  # 10 panels of 32
    model, pool = _model_and_pool(spec, torch.bfloat16)
    w = model.lm_head.weight.data
    v = w[0] / w[0].norm() * w.norm(dim=1).max() * 100  # far above every other logit
    w[37], w[300], w[38], w[301] = v, v, -v, -v  # each row's best is tied across threads
    for c in nan_columns:
        w[c] = float("nan")
    model.c_forward = LlamaForward.prepare(model, pool)
    ctx_lens = [2, 30, 11, 7, 19, 0, 5, 9]  # more than DOT_ROWS: the AMX whole step
    logits = _decode_step(model, pool, ctx_lens, fused=True)
    choices = _decode_step(model, pool, ctx_lens, fused=True, greedy=True)
    assert logits.shape == (8, 320) and choices.shape == (8,) and choices.dtype == torch.long
    assert choices.tolist() == logits.argmax(-1).tolist()
    want = {(): None, (250,): 250, (5, 250): 5}[nan_columns]
    if want is not None:
        assert choices.tolist() == [want] * 8
    else:
        assert sum(c in (37, 38) for c in choices.tolist()) >= 6  # ties, the first taken


@pytest.mark.parametrize("rows", [3, 8])
@pytest.mark.parametrize("nan_column", [None, 250])
def test_greedy_dot_product_steps_return_the_argmax_of_their_logits(rows, nan_column):
    """Without the AMX head (a few rows, or no AMX tiles) a greedy whole step writes the
    logits and returns their argmax, taken in C: torch.argmax's choice, NaN first."""
    spec = toy_spec()
    model, pool = _model_and_pool(spec, torch.bfloat16)
    if nan_column is not None:
        model.lm_head.weight.data[nan_column] = float("nan")
    model.c_forward = LlamaForward.prepare(model, pool)
    model.c_forward.amx = None  # dot products for every batch it takes
    ctx_lens = [2, 30, 11, 7, 19, 0, 5, 9][:rows]
    logits = _decode_step(model, pool, ctx_lens, fused=True)
    choices = _decode_step(model, pool, ctx_lens, fused=True, greedy=True)
    assert choices.shape == (rows,) and choices.dtype == torch.long
    assert choices.tolist() == logits.argmax(-1).tolist()
    if nan_column is not None:
        assert choices.tolist() == [nan_column] * rows


def test_greedy_requests_through_the_choices_give_the_tokens_of_the_logits(smol_loaded):
    """The engine asks the model for choices only when every row is plain greedy; a
    greedy request that also wants logprobs takes the logits path: the same tokens."""
    from tokenworks import LLM, SamplingParams

    llm = LLM(  # the dequantised weights: the packed products (AMX where it runs)
        "smollm2-135m", dtype="bfloat16", quantization="none", loaded=smol_loaded,
        kv_cache_memory=0.25,
    )  # fmt: skip
    kernel = llm.engine.c_kernels.forward_pass
    dims: list[int] = []  # what each whole C step returned: 1 choices, 2 logits
    run = kernel._run_whole_step

    def spy(*args, **kwargs):
        logits, choices = out = run(*args, **kwargs)
        dims.append(1 if choices is not None else 2)
        return out

    kernel._run_whole_step = spy
    prompts = [f"Count from {i} to {i + 9}:" for i in range(8)]  # 8 rows: AMX where it runs
    got, seen = {}, {}
    for logprobs in (None, 1):
        params = SamplingParams(max_tokens=12, temperature=0, ignore_eos=True, logprobs=logprobs)
        dims.clear()
        got[logprobs] = [o.outputs[0].token_ids for o in llm.generate(prompts, params)]
        seen[logprobs] = set(dims)
    assert got[None] == got[1]
    assert seen[1] == {2}  # logprobs need the logits
    assert seen[None] == {1}  # the choices, on AMX tiles or dot products


@pytest.mark.parametrize("variant", ["sliding-window", "gemma2"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_prefill_and_mixed_batches_through_the_kernel_equal_the_modules(dtype, variant):
    spec = dataclasses.replace(toy_spec(), **VARIANTS[variant] | {"sliding_window": 6})
    model, pool = _model_and_pool(spec, dtype)
    q_lens, ctx_lens = [5, 1, 3, 1], [0, 7, 2, 12]  # prefill chunks and decodes mixed
    tables = [[0, 1], [2, 3], [4, 5], [6, 7, 8, 9]]
    ids = torch.randint(
        0, spec.vocab_size, (sum(q_lens),), generator=torch.Generator().manual_seed(1)
    )
    pos = torch.cat([torch.arange(c, c + n) for n, c in zip(q_lens, ctx_lens, strict=True)])
    rows = torch.tensor([4, 5, 8, 9])  # each sequence's last row
    out = {}
    with torch.inference_mode():
        meta = AttentionMetadata.paged(q_lens, ctx_lens, tables, 4)
        out[False] = model(ids, pos, meta, pool, logits_rows=rows)
        batch = KernelBatch.build(q_lens, ctx_lens, tables, 4)
        c_forward = LlamaForward.prepare(model, pool)
        out[True], _ = c_forward.run(ids, pos, [batch], rows)
    assert out[True].shape == (4, spec.vocab_size)
    tol = 1e-4 if dtype == torch.float32 else 0.1  # bfloat16: the kernel keeps x in float32
    assert (out[True] - out[False]).abs().max() < tol * max(1.0, out[False].abs().max().item())


def _dequantized_copy(model):
    """The same model with every quantised layer replaced by float32 nn.Linear of its grid."""
    import copy

    from tokenworks.ops.linear import Int4Linear, Int8Linear, q4_dequantize

    ref = copy.deepcopy(model)
    for module in list(ref.modules()):
        for name, child in list(module.named_children()):
            if isinstance(child, Int4Linear):
                w = q4_dequantize(child.q4_blocks, child.in_features)
            elif isinstance(child, Int8Linear):
                w = child.qweight.float() * child.scale.float()[:, None]
            else:
                continue
            lin = torch.nn.Linear(
                child.in_features, child.out_features, bias=child.bias is not None
            )
            lin.weight.data.copy_(w)
            if child.bias is not None:
                lin.bias.data.copy_(child.bias.float())
            setattr(module, name, lin)
    return ref


@pytest.mark.parametrize("variant", ["gqa", "qkv-bias"])
def test_int4_fused_step_equals_its_dequantised_grid(variant):
    from tokenworks.ops.linear import Int4Linear

    spec = dataclasses.replace(toy_spec(), **VARIANTS[variant])
    model, pool = _model_and_pool(spec, torch.float32, "int4")
    assert any(isinstance(m, Int4Linear) for m in model.modules())
    ctx_lens = [1, 12, 33]
    want = _decode_step(_dequantized_copy(model), pool, ctx_lens, fused=False)
    model.c_forward = LlamaForward.prepare(model, pool)
    assert model.c_forward is not None
    got = _decode_step(model, pool, ctx_lens, fused=True)
    assert (got - want).abs().max() < 1e-4 * max(1.0, want.abs().max().item())


def test_q4_blocks_hold_the_int4_grid():
    from tokenworks.ops.linear import int4_dequantize, int4_quantize, q4_blocks, q4_dequantize

    w = torch.randn(48, 96)
    q, sz = int4_quantize(w)
    grid = int4_dequantize(q, sz)
    got = q4_dequantize(q4_blocks(q, sz), 96)
    # scale and minimum are stored in bfloat16: a weight moves by well under one step
    step = sz[..., 0].T.repeat_interleave(32, dim=1)
    assert ((got - grid).abs() / step).max() < 0.1
    assert ((got - w).abs() / step).max() < 0.6  # and stays within half a step of w


def test_batch_invariant_models_are_not_taken():
    spec = toy_spec()
    _, pool = _model_and_pool(spec, torch.float32)
    inv = build_model(spec, _weights(spec), torch.float32, batch_invariant=True)
    assert LlamaForward.prepare(inv, pool) is None


def test_the_real_model_in_bfloat16_decodes_through_the_kernel(smol_loaded):
    from tokenworks import LLM, SamplingParams

    llm = LLM("smollm2-135m", dtype="bfloat16", loaded=smol_loaded, kv_cache_memory=0.25)
    assert llm.engine.c_kernels is not None  # kernels="auto" takes them
    calls = []
    kernel = llm.engine.c_kernels.forward_pass
    for name in ("_run_whole_step", "run_batched"):
        run = getattr(kernel, name)
        setattr(kernel, name, lambda *a, _run=run, _n=name, **k: calls.append(_n) or _run(*a, **k))
    params = SamplingParams(max_tokens=24, temperature=0, ignore_eos=True)
    out = llm.generate(["The capital of France is"], params)[0].outputs[0]
    # batch-invariant by default: the prompt too is rows of one whole C step
    assert calls == ["_run_whole_step"] * 24
    assert "Paris" in out.text
    off = LLM("smollm2-135m", dtype="bfloat16", loaded=smol_loaded, kv_cache_memory=0.25,
              batch_invariant=False)  # fmt: skip
    calls.clear()
    kernel = off.engine.c_kernels.forward_pass
    for name in ("_run_whole_step", "run_batched"):
        run = getattr(kernel, name)
        setattr(kernel, name, lambda *a, _run=run, _n=name, **k: calls.append(_n) or _run(*a, **k))
    off.generate(["The capital of France is"], params)
    # without: the prompt through run_batched, every later token as one whole C step
    assert calls == ["run_batched"] + ["_run_whole_step"] * 23

"""The engine loop on the toy model: stopping, finish reasons, logprobs, streaming, batching."""

from __future__ import annotations

import pytest

from tokenworks import FinishReason, SamplingParams
from tokenworks.engine.engine import PromptTooLongError


def gen(llm, prompt="hello", **kw):
    return llm.generate([prompt], SamplingParams(**kw), use_tqdm=False)[0].outputs[0]


def test_max_tokens_ends_with_length(toy_llm):
    out = gen(toy_llm, max_tokens=7, temperature=0, ignore_eos=True)
    assert len(out.token_ids) == 7 and out.finish_reason is FinishReason.LENGTH


def test_a_stop_token_id_ends_with_stop(toy_llm):
    free = gen(toy_llm, max_tokens=12, temperature=0, ignore_eos=True)
    target = free.token_ids[5]
    out = gen(toy_llm, max_tokens=12, temperature=0, ignore_eos=True, stop_token_ids=[target])
    first = free.token_ids.index(target)
    assert out.token_ids == free.token_ids[: first + 1]
    assert out.finish_reason is FinishReason.STOP and out.stop_reason == target


def test_a_stop_string_is_cut_from_the_text(toy_llm):
    free = gen(toy_llm, "the quick brown fox", max_tokens=40, temperature=0, ignore_eos=True)
    text = free.text
    stop = next(text[i : i + 2] for i in range(10, len(text) - 2) if text[i : i + 2].isprintable())
    out = gen(
        toy_llm, "the quick brown fox", max_tokens=40, temperature=0, ignore_eos=True, stop=[stop]
    )
    assert out.text == text[: text.index(stop)]
    assert out.finish_reason is FinishReason.STOP and out.stop_reason == stop
    kept = gen(
        toy_llm,
        "the quick brown fox",
        max_tokens=40,
        temperature=0,
        ignore_eos=True,
        stop=[stop],
        include_stop_str_in_output=True,
    )
    assert kept.text == text[: text.index(stop) + len(stop)]


def test_the_same_seed_gives_the_same_text(toy_llm):
    a = gen(toy_llm, max_tokens=20, temperature=1.0, seed=11, ignore_eos=True)
    b = gen(toy_llm, max_tokens=20, temperature=1.0, seed=11, ignore_eos=True)
    c = gen(toy_llm, max_tokens=20, temperature=1.0, seed=12, ignore_eos=True)
    assert a.token_ids == b.token_ids and a.text == b.text
    assert a.token_ids != c.token_ids


def test_logprobs_come_with_each_token(toy_llm):
    out = gen(toy_llm, max_tokens=5, temperature=0, logprobs=3, ignore_eos=True)
    assert len(out.logprobs) == 5
    for tok, lp in zip(out.token_ids, out.logprobs, strict=True):
        assert lp.token_id == tok and len(lp.top) == 3
        assert lp.top[0][0] == tok  # greedy picks the most likely token
        assert lp.logprob == pytest.approx(lp.top[0][2])


def test_streamed_pieces_add_up_to_the_final_text(toy_llm):
    params = SamplingParams(max_tokens=30, temperature=0.9, seed=4, ignore_eos=True, stop=["zz"])
    streamed = "".join(toy_llm.stream("stream me", params))
    final = toy_llm.generate(["stream me"], params, use_tqdm=False)[0].outputs[0].text
    assert streamed == final


def test_more_requests_than_slots_all_finish_and_match_one_by_one(toy_llm):
    prompts = [f"prompt number {i}" for i in range(7)]  # 7 requests, 4 cache rows
    params = SamplingParams(max_tokens=9, temperature=0, ignore_eos=True)
    batch = [o.outputs[0].token_ids for o in toy_llm.generate(prompts, params)]
    single = [
        gen(toy_llm, p, max_tokens=9, temperature=0, ignore_eos=True).token_ids for p in prompts
    ]
    assert batch == single


def test_a_prompt_longer_than_the_context_is_refused(toy_llm):
    with pytest.raises(PromptTooLongError, match="shorten the prompt"):
        toy_llm.generate(["x" * 600], SamplingParams(max_tokens=4))


def test_generation_stops_at_the_context_end(toy_llm):
    out = toy_llm.generate(
        [[5] * 500], SamplingParams(max_tokens=100, temperature=0, ignore_eos=True)
    )
    assert len(out[0].outputs[0].token_ids) == 12  # 512-token context
    assert out[0].outputs[0].finish_reason is FinishReason.LENGTH


def test_token_ids_outside_the_vocabulary_are_refused(toy_llm):
    with pytest.raises(ValueError, match="outside the vocabulary"):
        toy_llm.generate([[1, 2, 100000]])


def test_int8_weights_stay_close_to_the_dense_model(toy_llm):
    import torch

    from tokenworks.models import build_model
    from tokenworks.ops.attention import AttentionMetadata

    loaded = toy_llm.engine.loaded
    ids = torch.arange(3, 40)
    meta = AttentionMetadata.single(len(ids))
    with torch.no_grad():
        dense = build_model(loaded.spec, loaded.weights, torch.bfloat16)(
            ids, torch.arange(37), meta
        )
        q = build_model(loaded.spec, loaded.weights, torch.bfloat16, quantization="int8")
        quant = q(ids, torch.arange(37), meta)
    assert (dense.softmax(-1) - quant.softmax(-1)).abs().max() < 0.05


def test_int8_linear_is_the_product_with_its_dequantised_weights():
    import torch

    from tokenworks.ops.linear import Int8Linear

    torch.manual_seed(0)
    dense = torch.nn.Linear(96, 40).to(torch.bfloat16)
    q = Int8Linear(dense)
    x = torch.randn(5, 96, dtype=torch.bfloat16)
    w = q.qweight.float() * q.scale.float()[:, None]
    assert (w - dense.weight.float()).abs().max() <= q.scale.float().max() / 2 + 1e-3
    expected = x.float() @ w.T + dense.bias.float()
    assert (q(x).float() - expected).abs().max() < 0.05


def test_int4_linear_is_the_product_with_its_dequantised_weights():
    import torch

    from tokenworks.ops.linear import Int4Linear, int4_dequantize, int4_quantize

    torch.manual_seed(0)
    dense = torch.nn.Linear(96, 48).to(torch.bfloat16)
    q = Int4Linear(dense)
    x = torch.randn(5, 96, dtype=torch.bfloat16)
    qw, sz = int4_quantize(dense.weight)
    w = int4_dequantize(qw, sz)
    step = sz[..., 0].max()
    assert (w - dense.weight.float()).abs().max() <= step / 2 + 1e-6
    expected = x.float() @ w.T + dense.bias.float()
    assert (q(x).float() - expected).abs().max() < 0.1
    # float32 callers get float32 back (the product itself runs in bfloat16)
    assert q(x.float()).dtype == torch.float32


def test_int4_recovers_weights_that_lie_on_a_q4_1_grid():
    import torch

    from tokenworks.ops.linear import int4_dequantize, int4_quantize

    torch.manual_seed(1)
    n, k = 32, 64
    codes = torch.randint(0, 16, (n, k // 32, 32))
    codes[..., 0], codes[..., 1] = 0, 15  # every group spans the full grid, as Q4_1 blocks do
    d, m = torch.rand(n, k // 32, 1) * 0.01 + 1e-3, torch.randn(n, k // 32, 1) * 0.05
    w = (codes * d + m).reshape(n, k)
    q, sz = int4_quantize(w)
    assert torch.equal(q.reshape(n, k // 32, 32), codes.int())
    assert (int4_dequantize(q, sz) - w).abs().max() < 1e-6


def test_int4_model_equals_the_dense_model_with_dequantised_weights(toy_llm):
    import torch

    from tokenworks.models import build_model
    from tokenworks.ops.attention import AttentionMetadata
    from tokenworks.ops.linear import Int4Linear, int4_dequantize, int4_quantize

    loaded = toy_llm.engine.loaded
    ids = torch.arange(3, 40)
    meta = AttentionMetadata.single(len(ids))
    quant = build_model(loaded.spec, loaded.weights, torch.float32, quantization="int4")
    dense = build_model(loaded.spec, loaded.weights, torch.float32)
    with torch.no_grad():
        l_orig = dense(ids, torch.arange(37), meta)
    replaced = 0
    with torch.no_grad():
        modules = dict(quant.named_modules())
        for name, m in dense.named_modules():
            if isinstance(modules.get(name), Int4Linear):
                m.weight.copy_(int4_dequantize(*int4_quantize(m.weight)))
                replaced += 1
        lq, ld = quant(ids, torch.arange(37), meta), dense(ids, torch.arange(37), meta)
    assert replaced >= 4 * loaded.spec.n_layers  # qkv, o, gate_up, down in every layer
    # the int4 kernel multiplies in bfloat16: agreement to bfloat16 precision, not float32,
    # and far closer than to the original weights (so the quantised grid is what runs)
    assert (lq - ld).abs().max() < 0.05 * ld.abs().max()
    assert (lq - ld).abs().mean() < 0.25 * (lq - l_orig).abs().mean()


@pytest.mark.parametrize("dtype", ["float32", "bfloat16", "float16"])
def test_every_dtype_generates_on_every_device(toy_llm, device, dtype):
    from tokenworks import LLM

    if dtype == "float16" and device == "cpu":
        pytest.skip("float16 runs on CUDA only")
    llm = LLM("toy", dtype=dtype, device=device, loaded=toy_llm.engine.loaded)
    params = SamplingParams(max_tokens=8, temperature=0, ignore_eos=True, logprobs=2)
    outs = llm.generate([[5, 6, 7], [9] * 40], params)
    for o in outs:
        c = o.outputs[0]
        assert len(c.token_ids) == 8 and c.finish_reason == "length"
        assert all(lp.logprob <= 0 and lp.logprob > -1e4 for lp in c.logprobs)


@pytest.mark.parametrize("method", ["int8", "int4"])
def test_a_dense_copy_serves_large_batches_with_the_same_grid(toy_llm, method):
    import torch

    from tokenworks.models import build_model
    from tokenworks.ops.attention import AttentionMetadata
    from tokenworks.ops.linear import DenseForLargeBatches

    loaded = toy_llm.engine.loaded
    quant = build_model(loaded.spec, loaded.weights, torch.float32, quantization=method)
    both = build_model(
        loaded.spec, loaded.weights, torch.float32, quantization=method, dense_from_rows=8
    )
    assert any(isinstance(m, DenseForLargeBatches) for m in both.modules())
    with torch.no_grad():
        ids = torch.arange(3, 40)
        meta = AttentionMetadata.single(37)
        lq, lb = quant(ids, torch.arange(37), meta), both(ids, torch.arange(37), meta)
        one = AttentionMetadata.single(1)
        sq, sb = quant(ids[:1], torch.arange(1), one), both(ids[:1], torch.arange(1), one)
    assert torch.equal(sq, sb)  # below the threshold: the quantised kernel itself
    assert (lq - lb).abs().max() < 0.05 * lq.abs().max()  # above: the same grid, dense


def test_matvec_linear_is_the_same_product_sharing_the_weights(toy_llm):
    import torch

    from tokenworks.models import build_model
    from tokenworks.ops.linear import MatvecLinear

    torch.manual_seed(0)
    lin = torch.nn.Linear(64, 48, bias=True).to(torch.bfloat16)
    mv = MatvecLinear(lin)
    assert mv.weight is lin.weight  # shared, not copied
    one, many = torch.randn(1, 64).to(torch.bfloat16), torch.randn(5, 64).to(torch.bfloat16)
    ref = one.float() @ lin.weight.float().T + lin.bias.float()
    assert torch.allclose(mv(one).float(), ref, atol=0.05, rtol=0.02)
    assert torch.equal(mv(many), lin(many))  # two or more rows: the ordinary product
    # bf16 on the CPU gets it, with the tied LM head still tied; float32 keeps nn.Linear
    loaded = toy_llm.engine.loaded
    model = build_model(loaded.spec, loaded.weights, torch.bfloat16)
    assert isinstance(model.lm_head, MatvecLinear)
    if loaded.spec.tie_embeddings:
        assert model.lm_head.weight is model.embed.weight
    assert not isinstance(build_model(loaded.spec, loaded.weights, torch.float32).lm_head,
                          MatvecLinear)  # fmt: skip

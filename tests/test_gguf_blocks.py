"""A GGUF file's blocks, executed as stored (kernels/blocks.py, csrc/block_products.h).

The oracle is the gguf package's own dequantisation (numpy, written from ggml's C) and a
float64 product of what it gives: each block format's products must equal that within the
bound the 8-bit activations allow, for 0, 1 and many rows and every block boundary, on the
AVX-512 VNNI path and on the plain C path CPUs without it take.
"""

from __future__ import annotations

from pathlib import Path

import gguf
import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from tokenworks.kernels import abi as ck
from tokenworks.kernels import block_linear, blocks
from tokenworks.kernels.block_linear import BlockLinear
from tokenworks.kernels.build import library

pytestmark = pytest.mark.skipif(library() is None, reason="no C compiler here")

# byte offsets of each format's float16 scale (and minimum) fields within a block
HALVES = {2: (0,), 3: (0, 2), 6: (0,), 7: (0, 2), 8: (0,), 10: (80, 82), 11: (108,),
          12: (0, 2), 13: (0, 2), 14: (208,), 16: (0,), 17: (0,), 18: (0,), 19: (0,),
          20: (0,), 21: (0,), 22: (0,), 23: (0,), 29: (), 34: (52,), 35: (64,), 39: ()}  # fmt: skip
POWERS = {39: 0}  # byte offsets of a power-of-two scale (MXFP4's E8M0: 2^(e - 128))
IQ1_M = 29  # its float16 scale is the top 4 bits of each of its four scale words
TYPES = sorted(blocks.EXECUTED)


def random_blocks(t: int, rows: int, cols: int, seed: int) -> np.ndarray:
    """Random bytes in the layout of type t, [rows, bytes], with finite float16 scales."""
    rng = np.random.default_rng(seed)
    el, by = blocks.block_shape(t)
    raw = rng.integers(0, 256, size=(rows, cols // el, by), dtype=np.uint8)
    for off in HALVES[t]:
        h = rng.uniform(-0.05, 0.05, size=(rows, cols // el)).astype(np.float16)
        raw[:, :, off : off + 2] = h.view(np.uint8).reshape(rows, cols // el, 2)
    if t in POWERS:
        raw[:, :, POWERS[t]] = rng.integers(118, 126, size=(rows, cols // el), dtype=np.uint8)
    if t == IQ1_M:
        h = rng.uniform(-0.05, 0.05, size=(rows, cols // el)).astype(np.float16).view(np.uint16)
        words = raw[:, :, 48:56].copy().view(np.uint16) & 0x0FFF  # [rows, blocks, 4]
        for i in range(4):
            words[..., i] |= ((h >> (4 * i)) & 0xF) << 12
        raw[:, :, 48:56] = words.view(np.uint8)
    return raw.reshape(rows, -1)


def reference(t: int, raw: np.ndarray, rows: int, cols: int) -> np.ndarray:
    return gguf.quants.dequantize(raw, t).reshape(rows, cols).astype(np.float64)


def activation_bound(x: np.ndarray, w: np.ndarray, span: int) -> np.ndarray:
    """The most a product can move from quantising x (float64 [M, K]) to int8 with one scale
    per `span` values: half a step of each value's scale, times |w|, plus float32 sums."""
    m, k = x.shape
    amax = np.abs(x.reshape(m, k // span, span)).max(-1)
    step = np.repeat(amax / 127.0, span, axis=1)  # [M, K]
    return (step / 2) @ np.abs(w).T * 1.0001 + 2e-5 * (np.abs(x) @ np.abs(w).T) + 1e-6


@pytest.mark.parametrize("t", TYPES, ids=[blocks.EXECUTED[t] for t in TYPES])
def test_dequantize_equals_the_gguf_package(t):
    el = blocks.block_shape(t)[0]
    raw = random_blocks(t, 9, el * 3, seed=t)
    w = blocks.from_array(t, (9, el * 3), raw)
    assert (
        w.dequantize().numpy().tolist() == reference(t, raw, 9, el * 3).astype(np.float32).tolist()
    )
    bf = w.dequantize(torch.bfloat16)
    assert torch.equal(bf, torch.from_numpy(reference(t, raw, 9, el * 3)).to(torch.bfloat16))


@pytest.mark.parametrize("portable", [False, True], ids=["vector", "portable"])
@settings(max_examples=40, deadline=None)
@given(
    t=st.sampled_from(TYPES),
    rows=st.integers(0, 20),
    out=st.integers(1, 40),
    blocks_per_row=st.integers(1, 5),
    seed=st.integers(0, 2**16),
)
def test_products_within_the_activation_bound(portable, t, rows, out, blocks_per_row, seed):
    el = blocks.block_shape(t)[0]
    k = el * blocks_per_row
    raw = random_blocks(t, out, k, seed)
    w64 = reference(t, raw, out, k)
    x = torch.randn(rows, k, generator=torch.Generator().manual_seed(seed))
    keep: list = []
    linear = blocks.c_linear([blocks.from_array(t, (out, k), raw)], None, keep)
    blocks.use_portable(portable)
    try:
        y = blocks.block_linear(x, linear, torch.float32).double().numpy()
    finally:
        blocks.use_portable(False)
    assert y.shape == (rows, out)
    x64 = x.double().numpy()
    span = 256 if el == 256 else 32
    err = np.abs(y - x64 @ w64.T)
    assert (err <= activation_bound(x64, w64, span)).all(), err.max()


GRIDS = [t for t in TYPES if blocks.EXECUTED[t][:3] in ("IQ1", "IQ2", "IQ3", "TQ1")]


@pytest.mark.parametrize("t", GRIDS, ids=[blocks.EXECUTED[t] for t in GRIDS])
def test_a_grid_formats_token_gets_the_same_bits_in_a_batch_of_any_size(t):
    """A prompt decodes each row of a grid format once for up to 64 tokens, a decode step
    once for its few: each token's sums are the same either way, to the bit."""
    rows, k = 5, 512
    keep: list = []
    linear = blocks.c_linear(
        [blocks.from_array(t, (rows, k), random_blocks(t, rows, k, t))], None, keep
    )
    x = torch.randn(70, k, generator=torch.Generator().manual_seed(t))
    alone = torch.cat([blocks.block_linear(x[i : i + 1], linear, torch.float32) for i in range(70)])
    for n in (2, 8, 9, 63, 64, 65, 70):
        assert torch.equal(blocks.block_linear(x[:n], linear, torch.float32), alone[:n]), n


@pytest.mark.parametrize(
    ("flags", "isa"), [(("-mno-avx512f",), "AVX2"), (("-mno-avx512f", "-mno-avx2"), "plain C")]
)
def test_builds_for_cpus_without_avx512_vnni_take_their_own_path(flags, isa):
    """Built for a CPU without AVX-512 (AVX2 products) or without AVX2 either (plain C), the
    kernels give this build's products (the same integer sums, up to float32 rounding) and
    dequantise to the same weights."""
    from tokenworks.kernels.build import variant

    if isa == "AVX2" and "avx2" not in Path("/proc/cpuinfo").read_text():
        pytest.skip("this CPU has no AVX2 to run an AVX2 build on")
    built = variant(*flags)
    assert blocks.vector_isa(built) == isa
    if isa == "plain C":
        assert built.tw_blocks_use_portable(0) == 1  # nothing else is built in it
    x = torch.randn(5, 512, generator=torch.Generator().manual_seed(0))
    for t in TYPES:
        keep: list = []
        raw = random_blocks(t, 24, 512, t)
        w = blocks.from_array(t, (24, 512), raw)
        linear = blocks.c_linear([w], None, keep)
        here = blocks.block_linear(x, linear, torch.float32)
        there = blocks.block_linear(x, linear, torch.float32, lib=built)
        assert torch.allclose(here, there, rtol=1e-4, atol=1e-3 * here.abs().max().item()), t
        for dtype in (torch.float32, torch.bfloat16):
            out = torch.empty(24, 512, dtype=dtype)
            data = w.data.contiguous()
            code = ck.DTYPE_CODES[dtype]
            built.tw_block_dequantize(ck.ptr(data), t, 24, 512, ck.ptr(out), code, 1)
            assert torch.equal(out, w.dequantize(dtype)), (t, dtype)


def test_parts_of_different_types_write_their_own_columns(monkeypatch):
    """A fused QKV whose V is Q6_K and Q/K Q4_K (as Q4_K_M files store them)."""
    q = blocks.from_array(12, (8, 256), random_blocks(12, 8, 256, 1))
    k = blocks.from_array(12, (4, 256), random_blocks(12, 4, 256, 2))
    v = blocks.from_array(14, (4, 256), random_blocks(14, 4, 256, 3))
    bias = torch.randn(16)
    fused = BlockLinear([q, k, v], bias)
    x = torch.randn(3, 256)
    y = fused(x)
    parts = [BlockLinear([p])(x) for p in (q, k, v)]
    assert torch.allclose(y, torch.cat(parts, dim=1) + bias, atol=1e-5)
    # more rows than BLOCK_ROWS: types the kernels repack stay on the blocks at any batch;
    # another (IQ4_XS) takes a dequantised tile and torch's product where bfloat16 is native
    big = torch.randn(60, 256)
    w64 = fused.dequantized(torch.float32).double().numpy()
    dense = big @ fused.dequantized(torch.float32).T + bias
    bound = activation_bound(big.double().numpy(), w64, 256)
    iq = BlockLinear([blocks.from_array(23, (8, 256), random_blocks(23, 8, 256, 4))])
    iq_dense = big @ iq.dequantized(torch.float32).T
    iq_bound = activation_bound(big.double().numpy(), iq.dequantized(torch.float64).numpy(), 256)
    for native in (True, False):
        monkeypatch.setattr(block_linear, "packed_built", lambda native=native: native)
        assert (np.abs((fused(big) - dense).double().numpy()) <= bound).all()
        if native:
            assert torch.allclose(iq(big), iq_dense, atol=1e-4)
        else:
            assert (np.abs((iq(big) - iq_dense).double().numpy()) <= iq_bound).all()


def test_a_type_not_executed_is_requantised_to_q8_0():
    rng = np.random.default_rng(0)
    w = rng.standard_normal((4, 256)).astype(np.float32)
    # Q4_K's own quantiser is not in the gguf package; BF16 stands for any type the kernels
    # do not execute (the loader reads BF16 as floats, so this calls executable directly)
    raw = gguf.quants.quantize(w, gguf.GGMLQuantizationType.BF16)
    t = blocks.executable(int(gguf.GGMLQuantizationType.BF16), (4, 256), raw)
    assert t.ggml_type == blocks.Q8_0
    assert np.allclose(t.dequantize().numpy(), w, atol=np.abs(w).max() / 100)


PROMPTS = [
    "Once upon a time, there was a little",
    "The three primary colours are",
    "def fibonacci(n):\n",
    "Question: What is the capital of France?\nAnswer:",
    "In the morning the market opens and",
    "Water boils at",
]


def test_the_files_blocks_pick_the_dequantised_models_tokens(smol_loaded):
    """Teacher-forced on the dequantised model's greedy continuations, the file's blocks
    (8-bit activations, float32 elsewhere) pick the same next token wherever the dequantised
    model's choice is not a near-tie; the flips at near-ties are counted and bounded."""
    from tokenworks import LLM, SamplingParams

    kw = dict(loaded=smol_loaded, dtype="float32", warmup=False, kv_cache_memory=0.1)
    ref = LLM("smollm2-135m", quantization="none", **kw)
    blocks_llm = LLM("smollm2-135m", quantization="gguf", **kw)
    assert blocks_llm.engine.quantization == "gguf"
    params = SamplingParams(max_tokens=24, temperature=0, ignore_eos=True)
    prompts = [ref.tokenizer.encode(p) for p in PROMPTS]
    outs = [o.outputs[0].token_ids for o in ref.generate(prompts, params, use_tqdm=False)]
    flips = near_ties = positions = 0
    for prompt, out in zip(prompts, outs, strict=True):
        ids = prompt + list(out)
        a = ref.engine.runner.run_uncached(ids)[len(prompt) - 1 : -1]
        b = blocks_llm.engine.runner.run_uncached(ids)[len(prompt) - 1 : -1]
        top2 = a.topk(2, dim=-1).values
        margin = top2[:, 0] - top2[:, 1]
        differ = a.argmax(-1) != b.argmax(-1)
        assert not (differ & (margin > 0.5)).any(), margin[differ]  # only near-ties flip
        flips += int(differ.sum())
        near_ties += int((margin <= 0.5).sum())
        positions += len(out)
    assert flips <= max(2, near_ties // 2), (flips, near_ties, positions)


NEWER = [10, 11, 16, 17, 18, 19, 20, 21, 22, 23, 29, 34, 35, 39]  # (beyond the catalogue's)


@pytest.mark.parametrize("t", NEWER, ids=[blocks.EXECUTED[t] for t in NEWER])
def test_a_file_of_the_type_keeps_its_blocks_at_the_file_s_size(t, tmp_path):
    """Loaded from a GGUF file, every matrix of the type stays its file's blocks (not a
    Q8_0 copy): the bytes held are the file's bytes of that type."""
    from gguf_files import write_small

    from tokenworks.models.gguf_file import _stored_tensors, load_gguf

    def typed(shape, seed):
        return (random_blocks(t, *shape, seed), t) if shape[1] % 256 == 0 else None

    head = {"{arch}.attention.key_length": 64}
    path = write_small(tmp_path / "typed.gguf", hidden=256, keys=head, blocks=typed)
    held = [v for v in load_gguf(path).weights.values() if isinstance(v, blocks.BlockTensor)]
    stored = [s for s in _stored_tensors(gguf.GGUFReader(path), path) if s.ggml_type == t]
    assert {b.ggml_type for b in held} == {t} and len(held) == len(stored) == 6
    assert sum(b.data.numel() for b in held) == sum(s.nbytes for s in stored)

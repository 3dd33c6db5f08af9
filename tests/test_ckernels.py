"""The C helpers on their own: the greedy argmax and the pieces between the products."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from tokenworks.kernels import abi, build, products

pytestmark = pytest.mark.skipif(
    build.library() is None, reason="the C kernels cannot be built here"
)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("width", [1, 15, 16, 17, 100, 49152])
def test_argmax_rows_equals_torch_argmax(dtype, width):
    g = torch.Generator().manual_seed(width)
    x = torch.randn(12, width, generator=g).to(dtype)
    x[1] = 1.0  # every value tied: the first index
    x[2] = float("-inf")
    if width > 1:
        x[3, width // 2] = float("nan")  # a NaN wins, as in torch
    if width > 40:
        x[4, 3] = x[4, 20] = 50.0  # a tie across vector lanes
        x[5, 17] = x[5, 33] = 50.0  # a tie within one lane
        x[6, 2] = x[6, -1] = float("nan")  # the first NaN
        x[7, -1] = 60.0  # the largest in the tail
    assert products.argmax_rows(x) == x.argmax(-1).tolist()


def test_argmax_rows_of_no_rows_and_of_other_tensors():
    assert products.argmax_rows(torch.empty(0, 5)) == []
    x = torch.randn(3, 7, dtype=torch.float64)  # not a kernel dtype: torch answers
    assert products.argmax_rows(x) == x.argmax(-1).tolist()
    y = torch.randn(9, 4).t()  # not contiguous
    assert products.argmax_rows(y) == y.argmax(-1).tolist()


@pytest.mark.parametrize("width", [64, 72])  # the vector path and the scalar tail
def test_swiglu_matches_torch_even_where_exp_overflows(width):
    lib = build.library()
    g = torch.Generator().manual_seed(0)
    gu = torch.randn(5, 2 * width, generator=g) * 4
    gu[0, :width] = torch.linspace(-200, 200, width)  # e^-g beyond float32 at both ends
    act = torch.empty(5, width)
    lib.tw_swiglu(abi.ptr(gu), abi.ptr(act), abi.F32, 5, width, 2)
    want = F.silu(gu[:, :width]) * gu[:, width:]
    assert torch.isfinite(act).all()
    torch.testing.assert_close(act, want, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("width", [64, 72])
@pytest.mark.parametrize("out_dtype", [torch.float32, torch.bfloat16])
def test_residual_norm_matches_torch(width, out_dtype):
    lib = build.library()
    g = torch.Generator().manual_seed(1)
    x = torch.randn(6, width, generator=g)
    delta = torch.randn(6, width, generator=g).to(out_dtype)
    w = torch.rand(width, generator=g) + 0.5
    h = torch.empty(6, width, dtype=out_dtype)
    x0 = x.clone()
    code = abi.DTYPE_CODES[out_dtype]
    lib.tw_residual_norm(
        abi.ptr(x),
        abi.ptr(delta),
        code,
        abi.ptr(w),
        1e-5,
        abi.ptr(h),
        code,
        6,
        width,
        2,
    )
    summed = x0 + delta.float()
    torch.testing.assert_close(x, summed, rtol=0, atol=0)  # the residual stream, exactly
    want = summed * torch.rsqrt(summed.pow(2).mean(-1, keepdim=True) + 1e-5) * w
    torch.testing.assert_close(h.float(), want.to(out_dtype).float(), rtol=1e-2, atol=1e-5)


@pytest.mark.parametrize("rows", [1, 5, 31, 32, 33, 64, 100, 256, 2050])
@pytest.mark.parametrize("with_bias", [False, True])
def test_amx_product_is_as_close_to_exact_as_torch(rows, with_bias, packed_products):
    """The packed product (tiles or vector) sums in float32 and rounds once to bfloat16,
    as torch does: its error against the float64 product is torch's, whatever the number
    of rows (partial 32-row tile blocks read zero-padded copies, partial 8-row vector
    blocks stop early) and whether there is a bias."""
    if packed_products is None:
        pytest.skip("no packed products on this CPU (AMX or AVX-512 BF16)")
    g = torch.Generator().manual_seed(rows)
    w = torch.randn(96, 160, generator=g).bfloat16()
    bias = torch.randn(96, generator=g).bfloat16() if with_bias else None
    x = torch.randn(rows, 160, generator=g).bfloat16()
    got = products.packed_product(w, bias)(x)
    want = x.double() @ w.double().t() + (0 if bias is None else bias.double())
    ours = (got.double() - want).abs().max().item()
    theirs = (F.linear(x, w, bias).double() - want).abs().max().item()
    assert got.dtype == torch.bfloat16 and got.shape == (rows, 96)
    assert ours <= 1.5 * theirs + 1e-6, (ours, theirs)


@pytest.mark.parametrize("rows", [1, 7, 64, 300])
@pytest.mark.parametrize("with_bias", [False, True])
def test_glu_product_is_swiglu_of_the_gate_and_up_products(rows, with_bias, packed_products):
    """amx_product(glu=True) of a gate_up weight [2I, K] (gate rows, then up rows) gives
    silu(gate) * up [M, I] from the float32 sums, rounded once: as close to the float64
    SwiGLU as torch's bfloat16 products and SwiGLU are, column for column (the packed
    copy interleaves gate and up 16 columns at a time; the output must not)."""
    if packed_products is None:
        pytest.skip("no packed products on this CPU (AMX or AVX-512 BF16)")
    g = torch.Generator().manual_seed(rows)
    inter, k = 96, 160
    w = torch.randn(2 * inter, k, generator=g).bfloat16()
    bias = torch.randn(2 * inter, generator=g).bfloat16() if with_bias else None
    x = torch.randn(rows, k, generator=g).bfloat16()
    got = products.packed_product(w, bias, glu=True)(x)
    gu = x.double() @ w.double().t() + (0 if bias is None else bias.double())
    want = F.silu(gu[:, :inter]) * gu[:, inter:]
    gu_t = F.linear(x, w, bias)
    theirs = (F.silu(gu_t[:, :inter]) * gu_t[:, inter:]).double()
    assert got.dtype == torch.bfloat16 and got.shape == (rows, inter)
    ours_err = (got.double() - want).abs().max().item()
    theirs_err = (theirs - want).abs().max().item()
    assert ours_err <= 1.5 * theirs_err + 1e-6, (ours_err, theirs_err)
    packed = products.pack_weight(w, glu=True)
    assert torch.equal(products.packed_product(w, bias, packed, glu=True)(x), got)


def test_glu_order_interleaves_gate_and_up_16_at_a_time():
    rows = torch.arange(64)  # gate 0-31, up 32-63
    want = [*range(0, 16), *range(32, 48), *range(16, 32), *range(48, 64)]
    assert products.glu_order(rows).tolist() == want
    w = torch.arange(64 * 3).view(64, 3)
    assert torch.equal(products.glu_order(w), w[want])


def test_amx_product_gives_the_same_bits_on_any_number_of_threads(packed_products):
    """Threads share a product's panels at run time (each its own run, then the others'
    tails): more threads than panels, or threads that find nothing left to take, must
    neither read outside the weights nor change a bit of the result."""
    if packed_products is None:
        pytest.skip("no packed products on this CPU (AMX or AVX-512 BF16)")
    g = torch.Generator().manual_seed(0)
    w = torch.randn(96, 160, generator=g).bfloat16()  # 3 panels of 32 columns
    x = torch.randn(70, 160, generator=g).bfloat16()
    product = products.packed_product(w)
    before = torch.get_num_threads()
    try:
        results = []
        for threads in (1, 2, 3, 5, 8):
            torch.set_num_threads(threads)
            results += [product(x) for _ in range(5)]
    finally:
        torch.set_num_threads(before)
    assert all(torch.equal(r, results[0]) for r in results)


def test_amx_product_declines_what_it_cannot_do():
    w = torch.randn(96, 160).bfloat16()
    assert products.packed_product(w[:, :150].contiguous()) is None  # K not a multiple of 32
    assert products.packed_product(w[:90].contiguous()) is None  # N not a multiple of 32
    assert products.packed_product(w.float()) is None  # bfloat16 only

"""Matrix products for the C paths: packed bfloat16 weights, oneDNN's, or torch's.

The packed products (csrc/packed_products.h) multiply bfloat16 weights copied once into a
panel layout: on AMX tiles where the CPU has them and Linux grants the tile state, else as
AVX-512 BF16 dot products on the same layout. Sums are float32, rounded once, as torch's
bfloat16 products are. `product` picks, per weight, the fastest of those this CPU runs.
"""

from __future__ import annotations

import contextlib
import functools

import torch

from tokenworks.kernels.abi import BF16, DTYPE_CODES, GLU, ptr
from tokenworks.kernels.build import library

PACK_ROWS = 64  # the batch size oneDNN tunes its packed weights for
# Products of more rows than this (prefill) multiply the plain weights where the packed
# products run on tiles (oneDNN is as fast there, and packing no longer pays); without
# tiles the packed vector products take every batch, being faster than oneDNN's.
PACK_MAX = 256

_vector_only = False  # within vector_products()


@functools.cache
def tiles_granted() -> bool:
    """Whether AMX tiles can run here: the kernels built with AMX (the CPU has it) and
    Linux granted this process the tile state."""
    lib = library()
    return lib is not None and bool(lib.tw_amx_init())


@functools.cache
def packed_built() -> bool:
    """Whether the packed products run here at all (the CPU has AVX-512 BF16)."""
    lib = library()
    if lib is None:
        return False
    tiles_granted()  # the tiles first, where they run
    return lib.tw_packed_kind() > 0


def use_tiles(on: bool) -> bool:
    """Run the packed products on tiles (where granted) or as vector dot products; the
    switch is the library's, for the whole process. Returns whether tiles are on."""
    lib = library()
    return lib is not None and bool(lib.tw_use_tiles(int(on and not _vector_only)))


def tiles_on() -> bool:
    """Whether the packed products run on AMX tiles now."""
    lib = library()
    return lib is not None and lib.tw_packed_kind() == 2


@contextlib.contextmanager
def vector_products():
    """Within it the packed products run as AVX-512 BF16 dot products even where tiles
    run, whatever an engine's options say: the path of CPUs without AMX, tested and
    measured on CPUs with both."""
    global _vector_only
    before = _vector_only
    _vector_only = True
    use_tiles(False)
    try:
        yield
    finally:
        _vector_only = before
        use_tiles(tiles_granted())


def glu_order(t: torch.Tensor) -> torch.Tensor:
    """The rows (or entries) of a gate_up weight (or bias), gate rows then up rows, in the
    order pack_weight(glu=True) packs them: gate 0-15, up 0-15, gate 16-31, up 16-31, ..."""
    n = t.shape[0]
    return t.reshape(2, n // 32, 16, *t.shape[1:]).transpose(0, 1).reshape(t.shape)


def packed_bias(bias: torch.Tensor | None, glu: bool = False) -> torch.Tensor | None:
    """A packed product's bias: float32, contiguous, in glu_order for glu products."""
    if bias is None:
        return None
    b = bias.detach().float()
    return (glu_order(b) if glu else b).contiguous()


def pack_weight(w: torch.Tensor, glu: bool = False) -> torch.Tensor | None:
    """A copy of bfloat16 w [N, K] in the packed layout (N and K multiples of 32), or None
    where the packed products cannot take it here. glu: w is a gate_up weight (gate rows,
    then up rows), packed in glu_order for products that end in SwiGLU."""
    if (
        not packed_built()
        or w.dtype != torch.bfloat16
        or w.device.type != "cpu"
        or w.dim() != 2
        or w.shape[0] % 32
        or w.shape[1] % 32
    ):
        return None
    n, k = w.shape
    w = glu_order(w.detach()).contiguous() if glu else w.detach().contiguous()
    packed = torch.empty(n * k, dtype=torch.bfloat16)
    library().tw_pack_weight(ptr(w), n, k, ptr(packed), torch.get_num_threads())
    return packed


def packed_product(w: torch.Tensor, bias=None, packed=None, glu: bool = False):
    """x -> x @ w.T (+ bias) on packed weights, for bfloat16 w [N, K] (packed: its
    pack_weight(w, glu) copy if already made), or None where that cannot run here. The
    result is bfloat16. glu: w is a gate_up weight [2I, K] and the result is SwiGLU's,
    silu(gate) * up [M, I], from the float32 sums."""
    packed = pack_weight(w, glu) if packed is None else packed
    if packed is None:
        return None
    lib = library()
    n, k = w.shape
    b = packed_bias(bias, glu)
    pw, pb = ptr(packed), ptr(b)  # kept alive by the closure below
    width, y_dtype = (n // 2, GLU) if glu else (n, BF16)

    def run(x: torch.Tensor) -> torch.Tensor:  # x: bfloat16 [M, K] on the CPU
        x = x if x.is_contiguous() else x.contiguous()
        y = torch.empty(x.shape[0], width, dtype=torch.bfloat16)
        threads = torch.get_num_threads()
        lib.tw_packed_linear(x.data_ptr(), x.shape[0], k, pw, n, pb, y.data_ptr(), y_dtype, threads)
        return y

    run.keep = (packed, b)
    return run


def swiglu(gu: torch.Tensor) -> torch.Tensor:
    """silu(gate) * up of a gate_up product's output [M, 2I] (gate, then up): [M, I]."""
    out = torch.empty(gu.shape[0], gu.shape[1] // 2, dtype=gu.dtype)
    library().tw_swiglu(
        gu.data_ptr(), out.data_ptr(), DTYPE_CODES[gu.dtype], gu.shape[0], out.shape[1],
        torch.get_num_threads(),
    )  # fmt: skip
    return out


def product(w: torch.Tensor, bias: torch.Tensor | None, packed=None, glu: bool = False):
    """x -> x @ w.T (+ bias): on packed (the weight's packed copy) where given, up to
    PACK_MAX rows on tiles and any number as vector products; else oneDNN's prepacked
    weights up to PACK_MAX rows; else, and for bigger batches on tiles, torch's product.

    glu: w is a gate_up weight (packed: its glu=True copy) and the callable returns
    SwiGLU's output [M, I]: the packed product computes it as it writes, the others'
    output goes through swiglu."""

    def plain(x):
        return torch.mm(x, w.t()) if bias is None else torch.addmm(bias, x, w.t())

    fast = packed_product(w, bias, packed, glu) if packed is not None else None
    if glu:
        if fast is None:
            inner = product(w, bias)
            return lambda x: swiglu(inner(x))
        return lambda x: fast(x) if x.shape[0] <= PACK_MAX or not tiles_on() else swiglu(plain(x))
    if fast is not None:
        return lambda x: fast(x) if x.shape[0] <= PACK_MAX or not tiles_on() else plain(x)
    if (
        w.device.type == "cpu"
        and w.dtype == torch.bfloat16
        and torch.backends.mkldnn.is_available()
    ):
        try:
            onednn = torch.ops.mkldnn._reorder_linear_weight(w, PACK_ROWS)
        except (RuntimeError, AttributeError):  # a torch without these ops
            return plain
        return lambda x: (
            torch.ops.mkldnn._linear_pointwise(x, onednn, bias, "none", [], "")
            if x.shape[0] <= PACK_MAX
            else plain(x)
        )
    return plain


def argmax_rows(x: torch.Tensor) -> list[int]:
    """x.argmax(-1).tolist() for a 2-D tensor (the first index of the largest value, or of
    the first NaN); in C for float32/bfloat16 on the CPU, many times faster than torch's
    over a batch of vocabulary-wide rows."""
    lib = library()
    if (
        lib is None
        or x.dim() != 2
        or x.device.type != "cpu"
        or x.dtype not in (torch.float32, torch.bfloat16)
        or x.shape[1] == 0
    ):
        return x.argmax(-1).tolist() if x.shape[0] else []
    x = x.contiguous()
    out = torch.empty(x.shape[0], dtype=torch.long)
    lib.tw_argmax_rows(
        ptr(x), DTYPE_CODES[x.dtype], x.shape[0], x.shape[1], ptr(out), torch.get_num_threads()
    )
    return out.tolist()

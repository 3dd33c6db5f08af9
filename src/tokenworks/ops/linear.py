"""Linear layers: dense (nn.Linear) and weight-only int8 / int4.

Batch-1 decode reads every weight once per token, so its speed is bytes moved: int8
weights move half the bytes of bfloat16, int4 a quarter. Activations stay in the model
dtype; torch's CPU kernels (`_weight_int8pack_mm`, `_weight_int4pack_mm_for_cpu`)
dequantise on the fly. Quantisation changes numerics, so it is a named engine option
(`quantization="int8"` or `"int4"`), never a default.

- int8: symmetric, one scale per output row.
- int4: asymmetric, one scale and one minimum per group of 32 inputs, the layout of the
  GGUF Q4_1 format the default model ships in, so re-quantising its dequantised weights
  recovers (up to bfloat16 rounding of scales) the very grid the file holds.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

INT4_GROUP = 32


class Int8Linear(nn.Module):
    def __init__(self, linear: nn.Linear):
        super().__init__()
        w = linear.weight.detach().float()  # [out, in]
        scale = w.abs().amax(dim=1).clamp(min=1e-8) / 127.0  # [out]
        self.register_buffer("qweight", torch.round(w / scale[:, None]).to(torch.int8))
        self.register_buffer("scale", scale.to(linear.weight.dtype))
        self.bias = linear.bias
        self.in_features, self.out_features = linear.in_features, linear.out_features

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # [..., in] -> [..., out]
        flat = x.reshape(-1, self.in_features)
        y = torch.ops.aten._weight_int8pack_mm(flat, self.qweight, self.scale.to(x.dtype))
        if self.bias is not None:
            y = y + self.bias
        return y.reshape(*x.shape[:-1], self.out_features)


def int4_quantize(w: torch.Tensor, group: int = INT4_GROUP) -> tuple[torch.Tensor, torch.Tensor]:
    """w [N, K] float -> (q [N, K] int32 in 0..15, scales_and_zeros [K/group, N, 2]).

    Dequantised value = (q - 8) * scale + zero, the convention of torch's int4 kernels,
    with zero = min + 8 * scale so that q = 0 is the group's minimum.
    """
    n, k = w.shape
    wg = w.float().reshape(n, k // group, group)
    lo, hi = wg.amin(-1), wg.amax(-1)  # [N, K/g]
    scale = ((hi - lo) / 15.0).clamp(min=1e-10)
    q = torch.round((wg - lo[..., None]) / scale[..., None]).clamp(0, 15).to(torch.int32)
    sz = torch.stack([scale, lo + 8.0 * scale], dim=-1).transpose(0, 1).contiguous()
    return q.reshape(n, k), sz


def int4_dequantize(q: torch.Tensor, sz: torch.Tensor, group: int = INT4_GROUP) -> torch.Tensor:
    """The float weights [N, K] that an int4 layer multiplies by (for tests and oracles)."""
    n, k = q.shape
    scale, zero = sz[..., 0].T, sz[..., 1].T  # [N, K/g]
    wg = (q.float().reshape(n, k // group, group) - 8.0) * scale[..., None] + zero[..., None]
    return wg.reshape(n, k)


def q4_blocks(q: torch.Tensor, sz: torch.Tensor) -> torch.Tensor:
    """int4_quantize's output as rows of 20-byte blocks [N, K/32 * 20] uint8 for the C kernels.

    The layout of GGUF's Q4_1 with bfloat16 in place of float16: scale d and minimum m,
    then 16 bytes whose low nibbles hold the block's elements 0-15 and high nibbles 16-31.
    """
    n, k = q.shape
    scale, zero = sz[..., 0].T, sz[..., 1].T  # [N, K/32]
    dm = torch.stack([scale, zero - 8.0 * scale], dim=-1).to(torch.bfloat16)
    qg = q.reshape(n, k // INT4_GROUP, INT4_GROUP)
    nibbles = (qg[..., :16] | (qg[..., 16:] << 4)).to(torch.uint8)  # [N, K/32, 16]
    return torch.cat([dm.view(torch.uint8), nibbles], dim=-1).reshape(n, -1).contiguous()


def q4_dequantize(blocks: torch.Tensor, k: int) -> torch.Tensor:
    """The float32 weights [N, K] that q4 blocks hold (the C kernels' exact grid)."""
    b = blocks.reshape(blocks.shape[0], k // INT4_GROUP, 20)
    dm = b[..., :4].contiguous().view(torch.bfloat16).float()  # [N, K/32, 2]
    lo, hi = (b[..., 4:] & 0xF).float(), (b[..., 4:] >> 4).float()
    q = torch.cat([lo, hi], dim=-1)  # [N, K/32, 32]
    return (q * dm[..., :1] + dm[..., 1:]).reshape(blocks.shape[0], k)


class Int4Linear(nn.Module):
    def __init__(self, linear: nn.Linear, group: int = INT4_GROUP):
        super().__init__()
        q, sz = int4_quantize(linear.weight.detach(), group)
        packed = torch.ops.aten._convert_weight_to_int4pack_for_cpu(q, 1)
        self.register_buffer("packed", packed)
        # the same grid in the blocks the C kernels read (kernels/forward.py)
        self.register_buffer("q4_blocks", q4_blocks(q, sz) if group == INT4_GROUP else None)
        self.register_buffer("scales_and_zeros", sz.to(linear.weight.dtype))
        self.bias = linear.bias
        self.group = group
        self.in_features, self.out_features = linear.in_features, linear.out_features

    @staticmethod
    def supports(linear: nn.Linear, group: int = INT4_GROUP) -> bool:
        """torch's packing needs out % 16 == 0 and in % group == 0."""
        return linear.out_features % 16 == 0 and linear.in_features % group == 0

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # [..., in] -> [..., out]
        # The kernel's float32 path is ~10x slower than its bfloat16 one, and int4 weights
        # are approximate anyway: multiply in bfloat16, hand back the caller's dtype.
        flat = x.reshape(-1, self.in_features).to(torch.bfloat16)
        sz = self.scales_and_zeros.to(torch.bfloat16)
        y = torch.ops.aten._weight_int4pack_mm_for_cpu(flat, self.packed, self.group, sz)
        y = y.to(x.dtype)
        if self.bias is not None:
            y = y + self.bias
        return y.reshape(*x.shape[:-1], self.out_features)


QUANTIZED_LINEARS = {"int8": Int8Linear, "int4": Int4Linear}


def dequantized_grid(method: str, linear: nn.Linear) -> torch.Tensor:
    """The float weights [out, in] the quantised layer multiplies by, in the layer's dtype."""
    w = linear.weight.detach()
    if method == "int4":
        return int4_dequantize(*int4_quantize(w)).to(w.dtype)
    q = Int8Linear(linear)
    return (q.qweight.float() * q.scale.float()[:, None]).to(w.dtype)


class DenseForLargeBatches(nn.Module):
    """A quantised layer plus a dense copy of the same (dequantised) weights.

    The weight-only kernels win while a product is a pass over the weights (a few rows:
    single-stream decode) and lose once it is compute-bound (prefill, big decode batches:
    on a 2-core CPU from about 8 rows). Above `rows` this uses the dense copy: the same grid
    of values, so the numerics barely move, at the memory cost of a dense copy.
    """

    def __init__(self, quantized: nn.Module, dense_weight: torch.Tensor, rows: int):
        super().__init__()
        self.quantized, self.rows = quantized, rows
        self.register_buffer("dense_weight", dense_weight)
        self.in_features, self.out_features = quantized.in_features, quantized.out_features

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.numel() // self.in_features < self.rows:
            return self.quantized(x)
        return F.linear(x, self.dense_weight.to(x.dtype), self.quantized.bias)


def quantize_(model: nn.Module, method: str, dense_from_rows: int | None = None) -> nn.Module:
    """Replace every nn.Linear in the model (the LM head included) by its quantised form.

    Layers whose shape the kernel cannot take (int4: out not a multiple of 16) stay dense.
    With dense_from_rows, each also keeps a dense copy for batches of that many rows or more.
    """
    if method not in QUANTIZED_LINEARS:
        raise ValueError(f"quantization {method!r}: expected one of {sorted(QUANTIZED_LINEARS)}")
    for name, child in list(model.named_children()):
        if isinstance(child, nn.Linear):
            if method != "int4" or Int4Linear.supports(child):
                setattr(model, name, quantized_linear(method, child, dense_from_rows))
        else:
            quantize_(child, method, dense_from_rows)
    return model


def quantized_linear(method: str, linear: nn.Linear, dense_from_rows: int | None) -> nn.Module:
    q = QUANTIZED_LINEARS[method](linear)
    if dense_from_rows is None:
        return q
    return DenseForLargeBatches(q, dequantized_grid(method, linear), dense_from_rows)


class MatvecLinear(nn.Module):
    """A dense layer that multiplies a single row with a matrix-vector product.

    Batch-1 decode is one row per layer, and torch's bfloat16 matrix product for one row
    streams the weights at well under the rate of `torch.mv` on the same tensors. Two or
    more rows take the ordinary product. The weights are the layer's own (shared, not
    copied), so a tied LM head stays tied. Rounding differs from the matrix product in the
    last bits, like any change of BLAS kernel: float32 and batch-invariant mode keep
    nn.Linear.
    """

    def __init__(self, linear: nn.Linear):
        super().__init__()
        self.weight, self.bias = linear.weight, linear.bias
        self.in_features, self.out_features = linear.in_features, linear.out_features

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.numel() != self.in_features:
            return F.linear(x, self.weight, self.bias)
        y = torch.mv(self.weight, x.reshape(-1))
        if self.bias is not None:
            y = y + self.bias
        return y.reshape(*x.shape[:-1], self.out_features)


def matvec_linears_(model: nn.Module) -> nn.Module:
    """Replace every nn.Linear of the model by a MatvecLinear sharing its weights."""
    for name, child in list(model.named_children()):
        if isinstance(child, nn.Linear):
            setattr(model, name, MatvecLinear(child))
        else:
            matvec_linears_(child)
    return model


class TiledLinear(nn.Module):
    """A linear layer whose every output row is computed the same way whatever the batch.

    BLAS picks different kernels (and so different float rounding) for different numbers
    of rows: a row computed alone (a matrix-vector product) can differ in the last bits
    from the same row inside a 16-row batch, which flips greedy ties now and then. Here
    every product runs on exactly `tile` rows (the last tile padded with zeros), so a row's
    result does not depend on its neighbours: the batch-invariant numerics mode.
    """

    def __init__(self, inner: nn.Module, tile: int = 16):
        super().__init__()
        self.inner, self.tile = inner, tile
        self.in_features, self.out_features = inner.in_features, inner.out_features

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        flat = x.reshape(-1, self.in_features)
        if flat.shape[0] == 0:
            return self.inner(x)
        out = in_tiles(flat, self.tile, self.inner)
        return out.reshape(*x.shape[:-1], self.out_features)


def in_tiles(x: torch.Tensor, tile: int, fn) -> torch.Tensor:
    """fn over x [m, in] in tiles of exactly `tile` rows (the last zero-padded) -> [m, out]:
    each row computed the same way whatever else is in the batch."""
    m = x.shape[0]
    pad = -m % tile
    if pad:
        x = torch.cat([x, x.new_zeros(pad, x.shape[1])])
    return torch.cat([fn(t) for t in x.split(tile)])[:m]


def tile_linears_(model: nn.Module, tile: int = 16) -> nn.Module:
    """Wrap every linear layer (dense or quantised) of the model in TiledLinear."""
    kinds = (nn.Linear, MatvecLinear, DenseForLargeBatches, *QUANTIZED_LINEARS.values())
    for name, child in list(model.named_children()):
        if isinstance(child, kinds):
            setattr(model, name, TiledLinear(child, tile))
        else:
            tile_linears_(child, tile)
    return model


def rows_product(x: torch.Tensor, w: torch.Tensor, tile: int | None = None) -> torch.Tensor:
    """x [n, in] @ w[out, in].T; with tile, over fixed tiles of rows (zero-padded) so a
    row's result does not depend on how many rows come with it (batch-invariant mode)."""
    if tile is None or x.shape[0] == 0:
        return F.linear(x, w)
    return in_tiles(x, tile, lambda t: F.linear(t, w))

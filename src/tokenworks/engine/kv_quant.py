"""An 8-bit KV cache (--kv-cache-dtype int8 or fp8_e4m3): each cached key or value vector
(one token, one KV head) is stored in one byte an element, with a float32 scale of its own.

A vector x is stored as q = x / s with s = max|x| / QMAX: int8 rounds q to the nearest
integer in [-127, 127] (an element's error at most s / 2), fp8 e4m3 keeps 3 bits of
mantissa (a relative error at most 2^-4, over a range to 448). Reading dequantises in
float32 and casts to the model's dtype. One scale per vector follows the outliers a key
head carries without letting them flatten the other heads or tokens, for 4 bytes per
head_dim bytes (6% of a 64-wide head).

Torch's attention reads the pool only through index_copy_ (writing the batch's new rows)
and index_select (gathering a context's rows): QuantizedKV gives those two and stands in
for a layer's K or V tensor there (ops/attention.py). The C kernels read and write the
same bytes and scales in place (kernels/csrc/kv_rows.h), a row at a time, dequantising
into float32 as their attention gathers it.
"""

from __future__ import annotations

import torch

from tokenworks.shapes import kv_bytes_per_token

SCALE_BYTES = 4  # a float32 scale per cached vector


def bytes_per_token(shape, dtype: str, kv_dtype: str) -> int:
    """Bytes one token adds to the cache (all layers, window not reached): in the model's
    dtype, or one byte an element and a scale per K and V head of each layer."""
    if kv_dtype == "auto":
        return int(kv_bytes_per_token(shape, dtype))
    return (
        int(kv_bytes_per_token(shape, "int8")) + 2 * shape.n_kv_heads * SCALE_BYTES * shape.n_layers
    )


def check_available(kv_dtype: str) -> None:
    """Raise where this torch cannot keep the format (fp8 e4m3 needs its float8 dtype)."""
    if kv_dtype == "fp8_e4m3" and not hasattr(torch, "float8_e4m3fn"):
        raise ValueError(f"kv_cache_dtype fp8_e4m3: torch {torch.__version__} has no float8")


class QuantizedKV:
    """One layer's K or V pool: `data` [slots, heads, dim] one byte an element (int8, or
    fp8 e4m3 kept as its bytes), `scale` [slots, heads] float32."""

    def __init__(self, data: torch.Tensor, scale: torch.Tensor, dtype, kv_dtype: str):
        self.data, self.scale, self.compute, self.kv_dtype = data, scale, dtype, kv_dtype
        self.qmax = 127.0 if kv_dtype == "int8" else 448.0

    @staticmethod
    def storage(kv_dtype: str) -> torch.dtype:
        return torch.int8 if kv_dtype == "int8" else torch.uint8

    @property
    def shape(self) -> torch.Size:
        return self.data.shape

    @property
    def dtype(self) -> torch.dtype:
        """The stored format (what the C kernels check before they read a pool)."""
        return torch.int8 if self.kv_dtype == "int8" else torch.float8_e4m3fn

    @property
    def device(self) -> torch.device:
        return self.data.device

    def element_size(self) -> int:
        return 1

    def quantize(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(the stored bytes, the scales) of vectors x [..., dim]."""
        x = x.float()
        s = x.abs().amax(-1, keepdim=True).clamp_min(1e-30) / self.qmax
        q = x / s
        if self.kv_dtype == "int8":
            return q.round_().clamp_(-127, 127).to(torch.int8), s.squeeze(-1)
        return q.to(torch.float8_e4m3fn).view(torch.uint8), s.squeeze(-1)

    def dequantize(self, q: torch.Tensor, s: torch.Tensor) -> torch.Tensor:
        """Vectors in the model's dtype from their stored bytes and scales."""
        values = q.float() if self.kv_dtype == "int8" else q.view(torch.float8_e4m3fn).float()
        return (values * s[..., None]).to(self.compute)

    def index_copy_(self, dim: int, index: torch.Tensor, x: torch.Tensor) -> QuantizedKV:
        """Write rows x [n, heads, dim] at pool slots `index` (dim 0)."""
        q, s = self.quantize(x)
        self.data.index_copy_(dim, index, q)
        self.scale.index_copy_(dim, index, s)
        return self

    def index_select(self, dim: int, index: torch.Tensor) -> torch.Tensor:
        """The rows at pool slots `index` (dim 0), dequantised: [n, heads, dim]."""
        q, s = self.data.index_select(dim, index), self.scale.index_select(dim, index)
        return self.dequantize(q, s)

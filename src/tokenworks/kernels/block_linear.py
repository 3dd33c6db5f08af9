"""Linear layers and embeddings on a GGUF file's own blocks (`--quantization gguf`).

A `BlockLinear` holds its weight as the file stores it (kernels/blocks.BlockTensor), in one
or more parts (a fused QKV whose V is Q6_K while Q and K are Q4_K: each part keeps its
type). Products multiply on the blocks in C, activations quantised to 8 bits. The types the
kernels repack (kernels/blocks.py) do so at every batch size: on a 2-core Zen 5 EPYC a
512 x 1,536 x 8,960 Q4_K product takes about 11 ms on the repacked rows, against about
15 ms for torch's bfloat16 product alone, before any dequantising. The other types take
more rows (prompts) through a weight dequantised to the activations' dtype for that one
product and torch's product, where the CPU multiplies bfloat16 natively (AVX-512 BF16).
Without the C kernels (another device, no compiler) every product dequantises.
"""

from __future__ import annotations

from collections.abc import Mapping

import torch
import torch.nn.functional as F
from torch import nn

from tokenworks.kernels.blocks import BlockTensor, block_linear, c_linear
from tokenworks.kernels.build import library
from tokenworks.kernels.products import packed_built

# Up to this many rows multiply on blocks not repacked where bfloat16 products are native;
# more dequantise for torch's product. On a 2-core EPYC with AVX-512 BF16 the integer products
# win to about 48 rows for 0.5B-1.5B shapes (a 1536 x 8960 Q4_K product: 3.6 ms against 7.5
# at 16 rows, 13.6 against 11.0 at 64).
BLOCK_ROWS = 48


class BlockLinear(nn.Module):
    def __init__(self, parts: list[BlockTensor], bias: torch.Tensor | None = None):
        super().__init__()
        if len({p.shape[1] for p in parts}) != 1:
            raise ValueError("the parts of a block product must share their input width")
        self.parts = parts
        for i, p in enumerate(parts):  # buffers, so .to() and state_dict see them
            self.register_buffer(f"blocks{i}", p.data, persistent=False)
        self.bias = nn.Parameter(bias, requires_grad=False) if bias is not None else None
        self.in_features = parts[0].shape[1]
        self.out_features = sum(p.shape[0] for p in parts)
        self._c = None  # (ck.Linear, what it points at), made on first use
        self.repack = True  # multiply the types the kernels repack on their repacked rows

    def c_view(self):
        """The C kernels' view of the product (kernels/abi.Linear)."""
        if self._c is None:
            keep: list = []
            view = c_linear(self.parts, self.bias, keep, self.repack)
            repacked = self.repack and all(p.packed is not None for p in self.parts)
            self._c = (view, keep, repacked)
        return self._c[0]

    def all_repacked(self) -> bool:
        """Whether every part multiplies on repacked rows (after c_view)."""
        return self._c is not None and self._c[2]

    def dequantized(self, dtype: torch.dtype) -> torch.Tensor:
        """The weight [out, in] in dtype (a new tensor each call)."""
        if len(self.parts) == 1:
            return self.parts[0].dequantize(dtype)
        return torch.cat([p.dequantize(dtype) for p in self.parts])

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # [..., in] -> [..., out]
        flat = x.reshape(-1, self.in_features)
        if (
            (flat.shape[0] <= BLOCK_ROWS or not packed_built() or self.all_repacked())
            and flat.device.type == "cpu"
            and flat.dtype in (torch.float32, torch.bfloat16)
            and library() is not None
        ):
            y = block_linear(flat, self.c_view(), x.dtype)
        else:
            y = F.linear(flat, self.dequantized(x.dtype).to(x.device), self.bias)
        return y.reshape(*x.shape[:-1], self.out_features)


class BlockEmbedding(nn.Module):
    """An embedding table kept as blocks: each lookup dequantises the rows it reads."""

    def __init__(self, table: BlockTensor):
        super().__init__()
        self.table = table
        self.register_buffer("blocks", table.data, persistent=False)
        # follows .to(dtype): the dtype a lookup returns, as nn.Embedding's weight would
        self.register_buffer("probe", torch.zeros(0), persistent=False)
        self.num_embeddings, self.embedding_dim = table.shape

    @property
    def dtype(self) -> torch.dtype:
        return self.probe.dtype

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        flat = ids.reshape(-1).cpu()
        rows = self.table.rows(flat)  # the looked-up rows' blocks (a small copy)
        out = rows.dequantize(torch.float32).to(self.probe.dtype).to(ids.device)
        return out.reshape(*ids.shape, self.embedding_dim)


def stored(linear: nn.Linear, parts: list, bias=None) -> nn.Module:
    """The layer for weights `parts` (stacked by rows): a BlockLinear where every part is a
    GGUF BlockTensor, else `linear` with the parts copied in as floats."""
    if all(isinstance(p, BlockTensor) for p in parts):
        return BlockLinear(parts, None if bias is None else dense(bias))
    linear.weight.copy_(torch.cat([dense(p) for p in parts], dim=0))
    if bias is not None:
        linear.bias.copy_(dense(bias))
    return linear


def dense(t):
    """A weight as float32: a BlockTensor dequantised, anything else as it is."""
    return t.dequantize(torch.float32) if isinstance(t, BlockTensor) else t


class DenseView(Mapping):
    """Weights whose BlockTensors read as float32, one at a time, as they are asked for:
    for modules that take dense weights only."""

    def __init__(self, weights: Mapping):
        self.weights = weights

    def __getitem__(self, name):
        return dense(self.weights[name])

    def __iter__(self):
        return iter(self.weights)

    def __len__(self):
        return len(self.weights)

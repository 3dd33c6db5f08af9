"""Linear layers: dense (nn.Linear) and weight-only int8 with one scale per output row.

Batch-1 decode reads every weight once per token, so its speed is bytes moved: int8
weights move half the bytes of bfloat16 and a quarter of float32. Activations stay in the
model dtype; `torch.ops.aten._weight_int8pack_mm` dequantises on the fly. Quantisation
changes numerics, so it is a named engine option (`quantization="int8"`), never a default.
"""

from __future__ import annotations

import torch
from torch import nn


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


def quantize_int8_(model: nn.Module) -> nn.Module:
    """Replace every nn.Linear in the model (the LM head included) with Int8Linear."""
    for name, child in list(model.named_children()):
        if isinstance(child, nn.Linear):
            setattr(model, name, Int8Linear(child))
        else:
            quantize_int8_(child)
    return model

"""LoRA in the forward pass: each product of a Llama-shaped layer wrapped so that a batch
mixing requests of several adapters and of the base model applies each row's own.

A LoRA adapter adds scale * B(A x) to a product W x, with A [r, in] and B [out, r] of a
small rank r. Rows of one adapter are gathered and take its two small products together
(the segmented product of punica and S-LoRA), so a batch of n adapters costs n pairs of
small matmuls per product, beside the one base product all rows share. Q, K and V are one
fused product here, and so are gate and up: each part adds its own adapter's delta into
its own slice of the output.
"""

from __future__ import annotations

import torch
from torch import nn

# PEFT's module names -> (the fused product of models/llama.py that holds it, which part)
TARGETS = {
    "q_proj": ("qkv", 0),
    "k_proj": ("qkv", 1),
    "v_proj": ("qkv", 2),
    "o_proj": ("o_proj", 0),
    "gate_proj": ("gate_up", 0),
    "up_proj": ("gate_up", 1),
    "down_proj": ("down", 0),
}


class BatchRows:
    """Which rows of the running forward belong to which adapter: set by the runner before
    each forward, read by every LoRALinear in it."""

    def __init__(self):
        self.groups: list[tuple[int, torch.Tensor]] = []  # (slot, its rows), base rows left out

    def set(self, slots: list[int], device) -> None:
        """slots: each row's adapter slot, -1 for the base model."""
        self.groups = []
        if not any(s >= 0 for s in slots):
            return
        at = torch.tensor(slots, device=device)
        for slot in sorted(set(slots) - {-1}):
            self.groups.append((slot, torch.nonzero(at == slot).flatten()))


class LoRALinear(nn.Module):
    """A product (nn.Linear or a GGUF block product) and the adapters' deltas on it.

    weights[slot][part] is (A, B, scale) or None where that adapter leaves the part alone;
    `bounds` are each part's output columns."""

    def __init__(self, base: nn.Module, bounds: list[tuple[int, int]], rows: BatchRows):
        super().__init__()
        self.base, self.bounds, self.rows = base, bounds, rows
        self.weights: dict[int, list[tuple | None]] = {}

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.base(x)
        for slot, rows in self.rows.groups:
            parts = self.weights.get(slot)
            if parts is None:
                continue
            xs = x.index_select(0, rows)
            for (lo, hi), part in zip(self.bounds, parts, strict=True):
                if part is None:
                    continue
                a, b, scale = part
                delta = (xs @ a.t()) @ b.t()
                y[rows, lo:hi] += (scale * delta).to(y.dtype)
        return y


def part_bounds(spec, product: str) -> list[tuple[int, int]]:
    """Each part's output columns in one of a layer's fused products."""
    if product == "qkv":
        q, kv = spec.q_size, spec.kv_size
        return [(0, q), (q, q + kv), (q + kv, q + 2 * kv)]
    if product == "gate_up":
        i = spec.intermediate_size
        return [(0, i), (i, 2 * i)]
    return [(0, spec.hidden_size)]


def wrap_layers(model, rows: BatchRows) -> dict[tuple[int, str], LoRALinear]:
    """Wrap every product LoRA can reach in the model's layers: (layer, product) -> its
    LoRALinear. Raises ValueError for a model whose layers it cannot reach."""
    wrapped = {}
    for layer in model.layers:
        if getattr(layer, "mla", None) is not None or getattr(layer, "moe", None) is not None:
            raise ValueError(
                "LoRA adapters apply to the attention and MLP products of dense Llama-shaped "
                "layers: this model has latent attention or experts"
            )
        for product in ("qkv", "o_proj", "gate_up", "down"):
            base = getattr(layer, product)
            if isinstance(base, LoRALinear):
                base = base.base
            lora = LoRALinear(base, part_bounds(model.spec, product), rows)
            setattr(layer, product, lora)
            wrapped[(layer.layer, product)] = lora
    return wrapped

"""LoRA in the forward pass: each product of a Llama-shaped layer wrapped so that a batch
mixing requests of several adapters and of the base model applies each row's own.

A LoRA adapter adds scale * B(A x) to a product W x, with A [r, in] and B [out, r] of a
small rank r. Every loaded adapter's A and B are laid side by side, and each row keeps the
columns of its own adapter (the masked form of punica's and S-LoRA's batched products), so
a batch mixing any number of adapters costs the same few matmuls per product, beside the
one base product all rows share. Q, K and V are one fused product here, and so are gate
and up: each part adds its own adapter's delta into its own slice of the output.
"""

from __future__ import annotations

import torch
from torch import nn

from tokenworks.kernels.lora_deltas import DeltaWeights, lora_add, runs_here

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
    """Which adapter each row of the running forward takes: set by the runner before each
    forward, read by every LoRALinear in it."""

    def __init__(self):
        self.slots: torch.Tensor | None = None  # [rows, 1] slot, -1 the base; None: no adapter
        # the deltas in C (kernels/lora_deltas.py), each row reading its own adapter alone,
        # where the engine runs the C kernels; else torch's masked products
        self.c_deltas = False
        self.c_slots: torch.Tensor | None = None  # int32 [rows], as C reads them

    def set(self, slots: list[int], device) -> None:
        """slots: each row's adapter slot, -1 for the base model."""
        has = any(s >= 0 for s in slots)
        self.slots = torch.tensor(slots, device=device)[:, None] if has else None
        self.c_slots = torch.tensor(slots, dtype=torch.int32) if has and self.c_deltas else None


class LoRALinear(nn.Module):
    """A product (nn.Linear or a GGUF block product) and the adapters' deltas on it.

    weights[slot][part] is (A, B, scale) or None where that adapter leaves the part alone;
    `bounds` are each part's output columns. pack() lays every adapter's A side by side and
    each part's B (scaled) side by side, so that a batch of any mix of adapters costs two
    matmuls a part: every row's x times every A, the columns of other adapters zeroed
    (exact zeros, so a row of the base model gets y exactly), times B."""

    def __init__(self, base: nn.Module, bounds: list[tuple[int, int]], rows: BatchRows):
        super().__init__()
        self.base, self.bounds, self.rows = base, bounds, rows
        self.weights: dict[int, list[tuple | None]] = {}
        self.packed: tuple | None = None  # (A's [C, in], each column's slot [C], parts)
        self.c_weights: DeltaWeights | None = None  # the same, as the C deltas read them

    def pack(self) -> None:
        """Lay the adapters' weights out for forward(), after any was loaded or dropped."""
        a_rows, col_slot, parts = [], [], []
        at = 0
        for i, bound in enumerate(self.bounds):
            bs = []
            for slot in sorted(self.weights):
                part = self.weights[slot][i]
                if part is not None:
                    a, b, scale = part
                    a_rows.append(a)
                    col_slot += [slot] * a.shape[0]
                    bs.append(b * scale)
            if bs:
                width = sum(b.shape[1] for b in bs)
                parts.append((bound, at, at + width, torch.cat(bs, dim=1)))
                at += width
        self.c_weights = DeltaWeights(self.bounds, self.weights) if self.rows.c_deltas else None
        if not a_rows:
            self.packed = None
            return
        slots = torch.tensor(col_slot, device=a_rows[0].device)[None, :]
        self.packed = (torch.cat(a_rows, dim=0), slots, parts)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.base(x)
        rows = self.rows.slots
        if rows is None or self.packed is None:
            return y
        if self.rows.c_slots is not None and runs_here(x) and y.dtype == x.dtype:
            lora_add(x.contiguous(), y, self.rows.c_slots, self.c_weights)
            return y
        a, col_slot, parts = self.packed
        u = x @ a.t()  # [rows, every adapter's rank]
        u *= rows == col_slot  # each row keeps its own adapter's columns
        for (lo, hi), c0, c1, b in parts:
            y[:, lo:hi] += u[:, c0:c1] @ b.t()
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
            lora = LoRALinear(getattr(layer, product), part_bounds(model.spec, product), rows)
            setattr(layer, product, lora)
            wrapped[(layer.layer, product)] = lora
    return wrapped

"""LoRA adapters' deltas in C (csrc/lora_deltas.h): each row of a product's output adds
its own adapter's B (A x), reading only that adapter's weights (engine/lora_layers.py lays
them out with `DeltaWeights`)."""

from __future__ import annotations

import ctypes

import torch

from tokenworks.kernels import abi as ck
from tokenworks.kernels.build import library


class DeltaWeights:
    """One product's adapters as tw_lora_add reads them: per part and slot, A [rank, in]
    and B transposed [rank, part width] with its scale applied, contiguous, in bfloat16
    where the adapters are (half the bytes a step streams), else float32.

    parts: each part's (lo, hi) output columns; weights: slot -> per part (A, B, scale) or
    None."""

    def __init__(self, parts: list[tuple[int, int]], weights: dict[int, list[tuple | None]]):
        n_slots = max(weights) + 1 if weights else 0
        self.n_parts, self.n_slots = len(parts), n_slots
        self.keep: list[torch.Tensor] = []
        count = self.n_parts * n_slots
        self.a = (ctypes.c_void_p * max(count, 1))()
        self.bt = (ctypes.c_void_p * max(count, 1))()
        self.rank = torch.zeros(max(count, 1), dtype=torch.int32)
        found = [part for per_part in weights.values() for part in per_part if part is not None]
        bf16 = found and found[0][0].dtype == torch.bfloat16  # (an engine's adapters: one dtype)
        self.dtype = torch.bfloat16 if bf16 else torch.float32
        for slot, per_part in weights.items():
            for p, part in enumerate(per_part):
                if part is None:
                    continue
                a, b, scale = part
                a_c = a.detach().to(self.dtype).contiguous()
                bt_c = (b.detach().float() * scale).t().to(self.dtype).contiguous()
                self.keep += [a_c, bt_c]
                i = p * n_slots + slot
                self.a[i], self.bt[i], self.rank[i] = a_c.data_ptr(), bt_c.data_ptr(), a.shape[0]
        self.lo = torch.tensor([lo for lo, _ in parts], dtype=torch.int64)
        self.hi = torch.tensor([hi for _, hi in parts], dtype=torch.int64)


def runs_here(x: torch.Tensor) -> bool:
    """Can tw_lora_add take these rows (the CPU, float32 or bfloat16, the library built)?"""
    return (
        x.device.type == "cpu"
        and x.dtype in (torch.float32, torch.bfloat16)
        and library() is not None
    )


def lora_add(x: torch.Tensor, y: torch.Tensor, slots: torch.Tensor, w: DeltaWeights) -> None:
    """y [rows, out] += each row's adapter's deltas on x [rows, in]; slots: int32 [rows],
    each row's adapter slot (-1: none). x and y of one dtype, contiguous."""
    library().tw_lora_add(
        x.data_ptr(), y.data_ptr(), ck.DTYPE_CODES[y.dtype], x.shape[0], x.shape[1],
        y.shape[1], slots.data_ptr(), w.n_parts, w.lo.data_ptr(), w.hi.data_ptr(), w.n_slots,
        w.a, w.bt, w.rank.data_ptr(), ck.DTYPE_CODES[w.dtype], torch.get_num_threads(),
    )  # fmt: skip

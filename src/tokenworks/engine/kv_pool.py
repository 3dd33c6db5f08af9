"""The KV pool: fixed-size blocks of keys and values for every layer, sized once from a
memory budget (engine/kv_budget.py). Token position p of a sequence lives in slot
`table[p // block_size] * block_size + p % block_size`; the tables and the counts of who
holds which block are engine/kv_cache.py's BlockManager."""

from __future__ import annotations

import math
import mmap

import torch

from tokenworks.engine.kv_groups import KVLayout
from tokenworks.engine.kv_quant import QuantizedKV


class KVPool:
    """The tensors: per layer, K [num_blocks * block_size, n_kv_heads, head_dim] and V the
    same with v_dim. v_dim 0 keeps no V: multi-head latent attention caches one row per
    token (its latent and RoPE key) in K alone (models/mla.py)."""

    def __init__(
        self,
        n_layers: int,
        num_blocks: int,
        block_size: int,
        n_kv_heads: int,
        head_dim: int,
        dtype: torch.dtype,
        device: torch.device | str = "cpu",
        v_dim: int | None = None,  # None: head_dim
        layout: KVLayout | None = None,  # None: one group, a tensor per layer
        layers: range | None = None,  # a pipeline stage's layers: tensors for these alone
        kv_dtype: str = "auto",  # "auto": dtype; "int8", "fp8_e4m3": engine/kv_quant.py
    ):
        slots = num_blocks * block_size
        v_dim = head_dim if v_dim is None else v_dim
        layout = layout or KVLayout.single(n_layers)
        self._maps: list[mmap.mmap] = []  # the CPU pool's memory (see _zeros)
        k_shape, v_shape = (slots, n_kv_heads, head_dim), (slots, n_kv_heads, v_dim)
        # one tensor per layer of a group; layer j of every group shares tensor j (a stage
        # leaves the tensors of other stages' layers empty)
        used = layout.slots(range(n_layers) if layers is None else layers)

        def tensor(j, shape, dt):
            if j in used:
                return self._zeros(shape, dt, device)
            return torch.empty(0, *shape[1:], dtype=dt, device=device)

        def side(shape):
            if kv_dtype == "auto":
                return [tensor(j, shape, dtype) for j in range(layout.size)]
            store = QuantizedKV.storage(kv_dtype)
            return [QuantizedKV(tensor(j, shape, store), tensor(j, shape[:2], torch.float32),
                                dtype, kv_dtype) for j in range(layout.size)]  # fmt: skip

        k = side(k_shape)
        v = side(v_shape) if v_dim else []
        parts = [p for x in k + v for p in ((x,) if kv_dtype == "auto" else (x.data, x.scale))]
        self.tensors = [t for t in parts if t.numel()]  # each once (the lists repeat them)
        self.k = [k[layout.slot_of(i)] for i in range(n_layers)]
        self.v = [v[layout.slot_of(i)] for i in range(n_layers)] if v_dim else []
        self.num_blocks, self.block_size, self.layout = num_blocks, block_size, layout
        self.dtype, self.kv_dtype = dtype, kv_dtype  # what attention reads; how it is kept

    def _zeros(self, shape, dtype, device) -> torch.Tensor:
        """A zero tensor; on the CPU in private anonymous memory, which the kernel fills
        with zeros a page at a time as it is first written: an idle pool takes no RAM,
        where a zero-filled tensor is resident in full from the start."""
        if torch.device(device).type != "cpu":
            return torch.zeros(shape, dtype=dtype, device=device)
        nbytes = math.prod(shape) * torch.empty(0, dtype=dtype).element_size()
        m = mmap.mmap(-1, nbytes, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
        self._maps.append(m)  # the tensor borrows the mapping's memory: keep it alive
        return torch.frombuffer(m, dtype=dtype).view(shape)

    @classmethod
    def for_spec(
        cls, spec, num_blocks: int, block_size: int, dtype, device="cpu", layout=None,
        layers=None, kv_dtype="auto",
    ) -> KVPool:  # fmt: skip
        """A pool laid out as the model's cache (ModelSpec.kv_layout), its layers grouped
        as `layout` says (KVLayout; None: one group), holding `layers` (None: all), kept
        as kv_dtype says."""
        heads, k_dim, v_dim = spec.kv_layout
        return cls(
            spec.n_layers, num_blocks, block_size, heads, k_dim, dtype, device, v_dim, layout,
            layers, kv_dtype,
        )  # fmt: skip

    def discard(self) -> None:
        """Forget every value in the pool (they read as zeros again) and give its pages
        back to the kernel: after the warm-up, whose filler prompts touched part of it.
        Only where no block holds anything anyone will read."""
        for m in self._maps:
            m.madvise(mmap.MADV_DONTNEED)

    def copy_blocks(self, pairs: list[tuple[int, int]]) -> None:
        """Copy each src block's K/V into dst (the copy half of copy-on-write)."""
        if not pairs:
            return
        bs = self.block_size
        src = torch.cat([torch.arange(s * bs, (s + 1) * bs) for s, _ in pairs])
        dst = torch.cat([torch.arange(d * bs, (d + 1) * bs) for _, d in pairs])
        src, dst = src.to(self.k[0].device), dst.to(self.k[0].device)
        for t in self.tensors:
            t[dst] = t[src]

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self.tensors)

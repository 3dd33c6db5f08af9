"""The one door to the C kernels: opened once per engine, asked once per batch.

`CKernels.open(model, pool, ...)` decides, from the model, its KV pool and the engine's
options, whether the C forward pass runs, and says why not where it does not. The runner
then asks `layout` for each flat batch: the batch laid out for C where the kernels take it
(None: the torch model runs it), and `forward` runs it.
"""

from __future__ import annotations

import logging

import torch

from tokenworks.kernels import KERNELS
from tokenworks.kernels.batch import KernelBatch
from tokenworks.kernels.build import library, unavailable
from tokenworks.kernels.forward import LlamaForward
from tokenworks.kernels.model_structs import declines
from tokenworks.kernels.products import packed_built, tiles_granted, use_tiles

log = logging.getLogger("tokenworks.kernels")
_warned: set[str] = set()


class KernelsUnavailableError(ValueError):
    """kernels="c" was asked for where the C kernels cannot run."""


class CKernels:
    def __init__(self, forward: LlamaForward, block_size: int, tiles: bool):
        self.forward_pass, self.block_size = forward, block_size
        self.tiles = tiles  # the packed products on AMX tiles (the library's switch, per call)

    @classmethod
    def open(
        cls,
        model: torch.nn.Module,
        pool,  # engine.kv_pool.KVPool
        block_size: int,
        kernels: str = "auto",
        device: str = "cpu",
        batch_invariant: bool = False,
        packed_products: bool = True,
        amx_tiles: bool = True,
    ) -> tuple[CKernels | None, str]:
        """(the kernels, "") where they run for this model, else (None, why not). kernels:
        "c" demands them (KernelsUnavailableError where they cannot run), "auto" takes them
        on the CPU for bfloat16 and quantised weights (float32 stays on torch's products,
        the exact path the oracle tests pin down), "torch" never. batch_invariant: every
        batch as rows of the whole step (`invariant` says whether this model got that)."""
        if kernels not in KERNELS:
            raise ValueError(f"kernels {kernels!r}: expected one of {', '.join(KERNELS)}")
        dtype = model.norm.dtype if hasattr(model, "norm") else None
        why = ""
        if kernels == "torch":
            return None, "kernels='torch' was asked for"
        if device != "cpu":
            why = f"the C kernels run on the CPU, not {device}"
        elif kernels == "auto" and dtype == torch.float32:
            return None, "float32 runs torch's products by default (kernels='c' takes C)"
        elif library() is None:
            why = f"the C kernels cannot be built here: {unavailable()}"
            if kernels == "auto" and why not in _warned:
                _warned.add(why)
                log.warning("%s; running torch's modules instead", why)
        if not why:
            spec = getattr(model, "spec", None)
            forward = LlamaForward.prepare(
                model, pool, packed=packed_products and packed_built(), tiles=amx_tiles,
                invariant=batch_invariant,
            )  # fmt: skip
            if forward is not None:
                tiles = amx_tiles and tiles_granted()
                return cls(forward, block_size, tiles), ""
            arch = spec.arch if spec is not None else type(model).__name__
            why = declines(model, pool) or (
                "a layer's weights are in a form it does not take (dense float32 or "
                "bfloat16, int8 rows, int4 blocks or a GGUF's blocks)"
            )
            why = f"the C forward pass declines this {arch} model: {why}"
            if kernels == "auto" and why not in _warned:
                _warned.add(why)  # once a reason, however many engines open
                log.info("%s; torch's modules run it", why)
        if kernels == "c":
            raise KernelsUnavailableError(f"kernels='c': {why}")
        return None, why

    @property
    def invariant(self) -> bool:
        """Whether every batch runs as whole-step rows (a row's logits never depend on the
        batch)."""
        return self.forward_pass.invariant

    def describe(self) -> str:
        """Which code computes the batches, in words."""
        if self.invariant:
            return "C kernels, batch-invariant: every batch as rows of the whole step"
        if not self.forward_pass.packs:
            return "C kernels (dot products), torch's products for big batches"
        where = "AMX tiles" if use_tiles(self.tiles) else "AVX-512 BF16 dot products"
        return f"C kernels, packed products on {where}"

    def layout(
        self, query_lens: list[int], context_lens: list[int], tables: list[list[list[int]]]
    ) -> list[KernelBatch] | None:
        """The batch laid out for C once per KV group (tables: each sequence's block
        tables, one per group), or None where the torch model is to run it."""
        if not self.forward_pass.accepts(query_lens):
            return None
        forward = self.forward_pass
        frees = forward.pool.layout.frees  # a windowed group's tables start at its window
        return [
            KernelBatch.build(
                query_lens, context_lens, [t[g] for t in tables], self.block_size,
                window if frees else None, self.invariant,
            )
            for g, window in enumerate(forward.windows)
        ]  # fmt: skip

    def forward(
        self, input_ids, positions, batches: list[KernelBatch], logits_rows, greedy: bool
    ) -> tuple[torch.Tensor | None, torch.Tensor | None]:
        """(logits [rows, V] in the computing dtype, None), or with greedy where the whole
        step runs in C, (None, each row's argmax [rows])."""
        use_tiles(self.tiles)
        return self.forward_pass.run(
            input_ids, positions, batches, logits_rows, float_logits=False, greedy=greedy
        )

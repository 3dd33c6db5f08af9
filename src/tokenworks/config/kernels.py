"""Which code runs the forward pass and how: the C kernels or torch's modules, packed and
repacked weights, tiles, compilation, batch invariance and how MoE layers run experts."""

from __future__ import annotations

from dataclasses import dataclass, field

from tokenworks.config.model import MEMORY
from tokenworks.kernels import KERNELS
from tokenworks.options import option

MOE_STRATEGIES = ("auto", "loop", "grouped", "dense")


@dataclass(frozen=True)
class KernelConfig:
    kernels: str = field(
        default="auto",
        metadata=option(
            "which code runs the forward pass: c (the C kernels of kernels/csrc: small decode "
            "batches as one call, C between torch's products otherwise, paged attention), "
            "torch (the torch modules: gathered K/V + SDPA), or auto: c on the CPU for "
            "bfloat16 and quantised weights where it builds, torch for float32",
            choices=KERNELS,
        ),
    )
    packed_products: bool = field(
        default=True,
        metadata=option(
            "with the C kernels, multiply packed copies of bfloat16 weights where the CPU "
            "has AMX or AVX-512 BF16 (off: oneDNN's and torch's products)"
        ),
    )
    amx_tiles: bool = field(
        default=True,
        metadata=option(
            "run the packed products and prompt attention on AMX tiles where the CPU has "
            "them (off: AVX-512 BF16 dot products)"
        ),
    )
    attention_tile: int | None = field(
        default=None,
        metadata=option(
            "the torch path's attention as exact tiles of N queries x N keys with an online "
            "softmax (ops/tiled_attention.py: scores never held for a whole row; on any "
            "device) instead of SDPA; with --kernels auto the torch path then runs the model",
            metavar="N",
        ),
    )
    compile: bool = field(
        default=False,
        metadata=option(
            "each decoder layer's dense work through torch.compile (Inductor: C++ on the "
            "CPU, Triton on CUDA), attention eager between (models/compiled.py); runs the "
            "torch modules, so a GGUF file needs --quantization none"
        ),
    )
    repack: bool = field(
        default=True,
        metadata=option(
            "with --quantization gguf, repack the block types the C kernels repack (Q4_0, "
            "Q4_1, Q5_0, Q5_1, Q8_0, IQ4_NL, MXFP4, Q2_K to Q6_K, IQ4_XS) eight rows at a time "
            "at load, into memory the process owns (the file's pages are given back); off: "
            "multiply the blocks as the file lays them out"
        ),
    )
    batch_invariant: bool | None = field(
        default=None,
        metadata=option(
            "a request's tokens never depend on what else is in its batch: every batch runs "
            "as rows of the C kernels' whole step (auto: where they run the model; on: "
            "elsewhere too, on torch's fixed tiles, slower; off: each batch size takes its "
            "fastest products)",
            group=MEMORY,
        ),
    )
    moe_strategy: str = field(
        default="auto",
        metadata=option(
            "how an MoE layer runs its experts: auto (by batch shape), loop (each touched "
            "expert on its tokens), grouped (touched experts in one batched product) or "
            "dense (every expert on every token)",
            group="mixture of experts",
            choices=["auto", "loop", "grouped", "dense"],
        ),
    )
    moe_capacity_factor: float | None = field(
        default=None,
        metadata=option(
            "an expert takes at most factor x tokens x top_k / experts tokens a step and the "
            "rest skip it (GShard); makes a token's output depend on its batch (default: off)",
            group="mixture of experts",
        ),
    )

    def __post_init__(self) -> None:
        self.check_kernels()

    def check_kernels(self) -> None:
        if self.kernels not in KERNELS:
            raise ValueError(f"kernels {self.kernels!r}: expected one of {', '.join(KERNELS)}")
        if self.attention_tile is not None and self.attention_tile < 1:
            raise ValueError("attention_tile must be >= 1 (or unset: SDPA)")
        if self.attention_tile is not None and self.kernels == "c":
            raise ValueError("attention_tile sets the torch path's attention; drop --kernels c")
        if self.compile and self.kernels == "c":
            raise ValueError("compile compiles the torch modules; drop --kernels c")
        if self.moe_strategy not in MOE_STRATEGIES:
            raise ValueError(
                f"moe_strategy {self.moe_strategy!r}: expected auto, loop, grouped or dense"
            )
        if self.moe_capacity_factor is not None and self.moe_capacity_factor <= 0:
            raise ValueError("moe_capacity_factor must be > 0 (or unset: no capacity limit)")

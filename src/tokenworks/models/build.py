"""Build a model module from loaded weights: `build_model` (models/__init__ names it)."""

from __future__ import annotations

import contextlib
import logging

import torch

from tokenworks.kernels.block_linear import BlockLinear, DenseView
from tokenworks.kernels.build import library
from tokenworks.models.arch import family
from tokenworks.models.gpt2 import GPT2Model
from tokenworks.models.llama import LlamaModel
from tokenworks.models.spec import ModelSpec
from tokenworks.ops.linear import (
    QUANTIZED_LINEARS,
    matvec_linears_,
    quantize_,
    quantized_linear,
    tile_linears_,
)

log = logging.getLogger("tokenworks.models")
MODULES = {"decoder": LlamaModel, "gpt2": GPT2Model}  # models/arch Family.module -> class
_INITS = ("kaiming_uniform_", "uniform_", "normal_", "zeros_", "ones_")


@contextlib.contextmanager
def _without_random_init():
    """Modules made without drawing their random initial weights: load_weights writes
    every parameter, and drawing the random numbers first would slow every start."""
    saved = {name: getattr(torch.nn.init, name) for name in _INITS}
    for name in _INITS:
        setattr(torch.nn.init, name, lambda tensor, *args, **kwargs: tensor)
    try:
        yield
    finally:
        for name, fn in saved.items():
            setattr(torch.nn.init, name, fn)


def build_model(
    spec: ModelSpec,
    weights: dict[str, torch.Tensor],
    dtype: torch.dtype,
    device: str = "cpu",
    quantization: str | None = None,
    batch_invariant: bool = False,
    dense_from_rows: int | None = None,
    moe_strategy: str = "auto",
    moe_capacity_factor: float | None = None,
    attention_tile: int | None = None,
    layers: range | None = None,  # a pipeline stage's layers (None: all)
    repack: bool = True,
) -> torch.nn.Module:
    with _without_random_init():  # (nor does a layer that will hold blocks touch its pages)
        module = MODULES[family(spec.arch).module]
        model = module(spec) if layers is None else module(spec, layers)
    blocks = quantization == "gguf" and isinstance(model, LlamaModel)
    model.load_weights(weights if blocks else DenseView(weights))
    if torch.device(device).type != "cpu" and hasattr(model, "cover_positions"):
        model.cover_positions(spec.max_position)  # whole before the move: no step fills it
    tables = getattr(model, "rope_tables", dict)()
    for name in tables:  # (out of the cast below, which would touch every row)
        del model._buffers[name]
    model = model.to(device=device, dtype=dtype).eval().requires_grad_(False)
    for name, t in tables.items():  # float32 whatever the dtype: shared with the C kernels
        model.register_buffer(name, t.to(device), persistent=False)
    if quantization in QUANTIZED_LINEARS:
        head = model.lm_head
        quantize_(model, quantization, dense_from_rows)
        if quantization == "int4" and head is not None:
            # The output layer is the most sensitive to rounding; GGUF files keep it at 8
            # bits or more (the default model: Q8_0), and so do we.
            model.lm_head = quantized_linear("int8", head, dense_from_rows)
    moes = model.moe_layers() if spec.moe else []
    if moe_strategy not in ("auto", "loop") and any(m.blocks is not None for m in moes):
        log.info("moe_strategy %s: the file's quantised experts run the loop (--quantization "
                 "none stacks them as floats for it)", moe_strategy)  # fmt: skip
    for moe in moes:
        moe.strategy, moe.capacity_factor = moe_strategy, moe_capacity_factor
    for layer in model.modules():  # (latent attention keeps SDPA)
        if hasattr(layer, "attention_tile"):
            layer.attention_tile = attention_tile
    if blocks and device == "cpu":
        repack_blocks_(model, repack)
    if batch_invariant:
        make_batch_invariant_(model)
    elif quantization in (None, "gguf") and dtype == torch.bfloat16 and device == "cpu":
        matvec_linears_(model)  # single-row products (batch-1 decode) via torch.mv
    return model


def repack_blocks_(model: torch.nn.Module, repack: bool) -> None:
    """Each product on a GGUF file's blocks told whether to multiply them repacked, and
    where it does, repacked now (at load, not on the first request)."""
    for m in model.modules():
        if isinstance(m, BlockLinear):
            m.repack = repack
            if repack and library() is not None:
                m.c_view()


def make_batch_invariant_(model: torch.nn.Module) -> torch.nn.Module:
    """torch's batch-invariant numerics, for models the C kernels' invariant whole step
    does not run: every product over fixed tiles of 16 rows (TiledLinear; an MoE layer's
    experts and latent attention's kv_b the same way)."""
    for moe in model.moe_layers() if model.spec.moe else []:
        moe.tile = 16
    for layer in model.layers if model.spec.mla else ():
        layer.mla.tile = 16
    return tile_linears_(model)

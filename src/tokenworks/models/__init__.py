"""Model sources, specs and architectures; `build_model` turns loaded weights into a module."""

from __future__ import annotations

import torch

from tokenworks.models.gpt2 import GPT2Model
from tokenworks.models.llama import LlamaModel
from tokenworks.models.loader import LoadedModel, ModelLoadError, load
from tokenworks.models.spec import ModelSpec
from tokenworks.ops.linear import quantize_int8_

ARCHITECTURES = {"llama": LlamaModel, "gpt2": GPT2Model}


def build_model(
    spec: ModelSpec,
    weights: dict[str, torch.Tensor],
    dtype: torch.dtype,
    device: str = "cpu",
    quantization: str | None = None,
) -> torch.nn.Module:
    model = ARCHITECTURES[spec.arch](spec)
    model.load_weights(weights)
    model = model.to(device=device, dtype=dtype).eval().requires_grad_(False)
    if quantization == "int8":
        quantize_int8_(model)
    return model


__all__ = ["ARCHITECTURES", "LoadedModel", "ModelLoadError", "ModelSpec", "build_model", "load"]

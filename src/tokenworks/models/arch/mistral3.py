"""Mistral 3 (`mistral3`): the text model of Mistral Small 3.1/3.2 and of Ministral 3 and
Devstral 2. Llama's layout; Ministral 3 adds YaRN and Llama 4's query temperature, which
sharpens attention past the trained context (spec.QueryTemperature)."""

from __future__ import annotations

import dataclasses

from tokenworks.models import gguf_keys
from tokenworks.models.arch.family import Family
from tokenworks.models.arch.llama import GGUF_BLOCK
from tokenworks.models.spec import QueryTemperature


def _spec_fields(cfg: dict) -> dict:
    rope = cfg.get("rope_parameters") or cfg.get("rope_scaling") or {}
    beta = rope.get("llama_4_scaling_beta")
    if not beta:
        return {}
    length = int(rope.get("original_max_position_embeddings") or cfg["max_position_embeddings"])
    return {"query_temperature": QueryTemperature(float(beta), length)}


def _gguf_fields(get, arch: str) -> dict:
    """llama.cpp's reading of a mistral3 file: YaRN's `yarn_log_multiplier` is mscale_all_dim
    itself (mscale 1), and the temperature's length is YaRN's original context."""
    context = int(get(f"{arch}.context_length"))
    scaling = gguf_keys.rope_scaling(get, arch, context)
    out = {}
    if scaling is not None and scaling.kind == "yarn":
        log_mul = get(f"{arch}.rope.scaling.yarn_log_multiplier")
        mscales = (1.0, float(log_mul)) if log_mul else (None, None)
        out["rope_scaling"] = dataclasses.replace(
            scaling, mscale=mscales[0], mscale_all_dim=mscales[1])
    beta = get(f"{arch}.attention.temperature_scale")
    if beta:
        length = scaling.original_max_position if scaling is not None else context
        out["query_temperature"] = QueryTemperature(float(beta), length)
    return out


FAMILY = Family(
    name="mistral3",
    hf_model_types=("ministral3",),
    spec_fields=_spec_fields,
    gguf_archs=("mistral3",),
    gguf_block=GGUF_BLOCK,
    gguf_keys={
        "rope.scaling.yarn_log_multiplier": "YaRN's mscale_all_dim (its mscale is 1)",
        "attention.temperature_scale": "the queries' temperature beta (Llama 4's scaling)",
    },
    gguf_fields=_gguf_fields,
)

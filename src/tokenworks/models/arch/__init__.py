"""The architecture registry: one module per family, each saying how its config.json and
its weight names (Hugging Face and GGUF) map onto a ModelSpec and the engine's names.

The engine's weight names are Hugging Face's Llama names plus the Qwen-MoE / DeepSeek
ones for what Llama lacks (`self_attn.q_norm`, `mlp.gate` for the router,
`mlp.experts.{e}.gate_proj`, `mlp.shared_experts.*`, MLA's `kv_a_proj_with_mqa` ...).
A family whose files name things otherwise lists the renames; a family that lays weights
out otherwise (DeepSeek's interleaved RoPE pairs) rewrites them in `prepare`. Adding a
family is one module here plus its tests.
"""

from __future__ import annotations

from tokenworks.models.arch import (
    deepseek,
    deepseek_v2,
    gemma,
    gpt2,
    gpt_oss,
    granite,
    llama,
    llama4,
    mistral3,
    mixtral,
    olmo2,
    phi3,
    qwen2_moe,
    qwen3,
    qwen3_moe,
    smollm3,
)
from tokenworks.models.arch.family import Family, UnknownArchitectureError


def _families() -> dict[str, Family]:
    modules = (llama, gpt2, qwen3, gemma, phi3, smollm3, olmo2, mixtral, qwen2_moe, qwen3_moe,
               deepseek_v2, deepseek, gpt_oss, granite, mistral3, llama4)  # fmt: skip
    # a module declares FAMILY, or FAMILIES where one file holds close relatives
    found = [f for m in modules for f in getattr(m, "FAMILIES", (getattr(m, "FAMILY", None),))]
    return {f.name: f for f in found}


_REGISTRY: dict[str, Family] = {}


def families() -> dict[str, Family]:
    if not _REGISTRY:
        _REGISTRY.update(_families())
    return _REGISTRY


def family(name: str) -> Family:
    try:
        return families()[name]
    except KeyError:
        raise UnknownArchitectureError(
            f"unsupported architecture {name!r}: the families here are {', '.join(families())}"
        ) from None


def _names(attr: str) -> list[str]:
    """Every family's hf_model_types or gguf_archs, sorted."""
    return sorted(x for f in families().values() for x in getattr(f, attr))


def _reading(attr: str, value: str | None) -> Family | None:
    return next((f for f in families().values() if value in getattr(f, attr)), None)


def for_hf_model_type(model_type: str | None) -> Family:
    found = _reading("hf_model_types", model_type)
    if found is None:
        raise UnknownArchitectureError(
            f"model_type {model_type!r} is not supported; supported: "
            f"{', '.join(_names('hf_model_types'))}"
        )
    return found


def for_gguf_arch(arch: str | None) -> Family:
    found = _reading("gguf_archs", arch)
    if found is None:
        raise UnknownArchitectureError(
            f"GGUF architecture {arch!r} is not supported; supported: "
            f"{', '.join(_names('gguf_archs'))} (other families load from a Hugging Face "
            f"directory: {', '.join(_names('hf_model_types'))})"
        )
    return found


__all__ = [
    "Family",
    "UnknownArchitectureError",
    "families",
    "family",
    "for_gguf_arch",
    "for_hf_model_type",
]

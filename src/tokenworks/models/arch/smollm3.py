"""SmolLM3: Llama's layout, with every fourth layer rotating neither Q nor K (NoPE), so
those layers attend by content alone."""

from __future__ import annotations

from tokenworks.models.arch.family import Family
from tokenworks.models.arch.llama import GGUF_BLOCK

NOPE_EVERY = 4  # llama.cpp's step for SmolLM3: no GGUF key says it


def _spec_fields(cfg: dict) -> dict:
    """config.json lists each layer's RoPE use (1: rotates), or gives the interval."""
    n = cfg["num_hidden_layers"]
    uses = cfg.get("no_rope_layers")
    if uses is None:
        every = cfg.get("no_rope_layer_interval", NOPE_EVERY)
        uses = [int((i + 1) % every != 0) for i in range(n)]
    return {"nope_layers": tuple(i for i, u in enumerate(uses) if not u)}


def _gguf_fields(get, arch: str) -> dict:
    n = int(get(f"{arch}.block_count"))
    return {"nope_layers": tuple(i for i in range(n) if (i + 1) % NOPE_EVERY == 0)}


FAMILY = Family(
    name="smollm3",
    hf_model_types=("smollm3",),
    spec_fields=_spec_fields,
    gguf_archs=("smollm3",),
    gguf_block=GGUF_BLOCK,
    gguf_fields=_gguf_fields,
)

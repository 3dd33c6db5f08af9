"""Family: what one architecture module declares (models/arch/__init__.py keeps them)."""

from __future__ import annotations

import re
from collections.abc import Callable
from dataclasses import dataclass, field


class UnknownArchitectureError(ValueError):
    """A config or file naming an architecture no family here reads."""


@dataclass(frozen=True)
class Family:
    name: str  # ModelSpec.arch
    hf_model_types: tuple[str, ...]  # config.json "model_type" values it reads
    module: str = "decoder"  # the torch module and reference that run it: decoder or gpt2
    # config.json -> the ModelSpec fields beyond the shared shape (moe, mla, qk_norm, ...)
    spec_fields: Callable[[dict], dict] = lambda cfg: {}
    # Hugging Face names -> engine names: (regex, replacement) applied in order
    hf_renames: tuple[tuple[str, str], ...] = ()
    # GGUF "general.architecture" values it reads, and its per-block tensor names: a
    # tensor holding several engine weights stacked by rows (Phi-3's attn_qkv) names
    # them all, in order (models/gguf_file.py splits it)
    gguf_archs: tuple[str, ...] = ()
    gguf_block: dict[str, str | tuple[str, ...]] = field(default_factory=dict)
    # `{arch}.` key suffixes this family reads beyond models/gguf_keys.ARCH_READ
    gguf_keys: dict[str, str] = field(default_factory=dict)
    # GGUF metadata (a key -> value getter, the arch prefix) -> extra ModelSpec fields,
    # and "stop_token_ids" to end replies on besides the file's EOS
    gguf_fields: Callable[[Callable, str], dict] = lambda get, arch: {}
    # Hugging Face weights under engine names, the spec -> the weights the module reads
    # (GGUF files come in llama.cpp's conventions, which the engine's names follow)
    prepare: Callable[[dict, object], dict] = lambda weights, spec: weights
    # the same for a GGUF's weights, where the family's files depart from llama.cpp's
    # conventions for Llama (DeepSeek's interleaved RoPE rows, MLA's split kv_b)
    gguf_prepare: Callable[[dict, object], dict] = lambda weights, spec: weights

    def rename(self, name: str) -> str:
        for pattern, repl in self.hf_renames:
            name = re.sub(pattern, repl, name)
        return name

"""What loading a model gives: its spec, its weights under Hugging Face names, where its
tokenizer and chat template come from, and the file it came from."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from tokenworks.models.spec import ModelSpec

if TYPE_CHECKING:
    from tokenworks.models.gguf_file import GGUFIndex


class ModelLoadError(ValueError):
    """A model file or directory that cannot be used, with what to do about it."""


@dataclass
class LoadedModel:
    spec: ModelSpec
    # Hugging Face names -> float32 tensors, or (GGUF) kernels.blocks.BlockTensor
    weights: dict
    tokenizer_source: dict  # {"kind": "gguf", "fields": {...}} or {"kind": "json", "path": ...}
    chat_template: str | None
    model_id: str  # what the user asked for
    file_sha256: str | None  # of the weights file, where there is one file
    file_path: str
    gguf_index: GGUFIndex | None = None  # a GGUF's tensor table (models/converted.py)
    # the tokenizer built from a GGUF's vocabulary, with the fields it was built from, so
    # the engines over one load build it once (Gemma's 262k pieces take seconds)
    built_tokenizer: tuple | None = field(default=None, repr=False, compare=False)

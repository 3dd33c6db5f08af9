"""Model sources -> (ModelSpec, float32 weights under Hugging Face names, tokenizer source).

Four sources, tried in this order for a model argument (after the builtin "toy"):
  1. a catalogue name (`smollm2-135m`): fetched into the cache, sha256-checked;
  2. a path to a `.gguf` file: read with the `gguf` package, dequantised to float32;
  3. a path to a Hugging Face-format directory: config.json, *.safetensors, tokenizer.json;
  4. a hub id (`org/name`): fetched with `huggingface_hub` into its cache, then as 3.

Weights come out under Hugging Face's names, so every architecture file reads one naming.
No pickle is ever loaded: GGUF and safetensors only.
"""

from __future__ import annotations

import logging
import re
from pathlib import Path

from tokenworks.models import catalogue, converted
from tokenworks.models.gguf_file import load_gguf
from tokenworks.models.hf_dir import fetch_from_hub, load_hf_dir
from tokenworks.models.loaded import LoadedModel, ModelLoadError
from tokenworks.models.toy import load_toy

log = logging.getLogger(__name__)


def load(model: str, weights: bool = True, keep_index: bool = True) -> LoadedModel:
    """Resolve a model argument to weights and a spec (see the module docstring).

    weights=False reads only the spec, tokenizer and chat template (`weights` is empty):
    what a process that tokenises for an engine elsewhere needs, at a fraction of the
    memory and time. keep_index=False reads a GGUF's metadata from the file even where an
    index of it is kept (models/converted.py), and keeps none."""
    if model == "toy":
        return load_toy(weights)
    if model in catalogue.CATALOGUE:
        entry = catalogue.lookup(model)
        path = catalogue.pull(model)
        loaded = load_gguf_once(path, model, entry.sha256, weights, keep_index)
        loaded.chat_template = loaded.chat_template or entry.chat_template
        return loaded
    path = Path(model).expanduser()
    if path.is_file():
        if path.suffix != ".gguf":
            raise ModelLoadError(f"{path} is a file but not a .gguf; pass a .gguf or a directory")
        return load_gguf_once(path, model, weights=weights, keep_index=keep_index)
    if path.is_dir():
        return load_hf_dir(path, model_id=model, weights=weights)
    if re.fullmatch(r"[\w.-]+/[\w.-]+", model) and not model.startswith((".", "/")):
        return load_hf_dir(fetch_from_hub(model), model_id=model, weights=weights)
    catalogue.lookup(model)  # raises ModelNotFoundError naming the choices
    raise AssertionError("unreachable")


def load_gguf_once(
    path: Path,
    model_id: str,
    sha256: str | None = None,
    weights: bool = True,
    keep_index: bool = True,
) -> LoadedModel:
    """load_gguf, from the index kept of the file where there is one (models/converted.py)."""
    if not keep_index:
        loaded = load_gguf(path, model_id=model_id, weights=weights)
        loaded.file_sha256 = sha256
        return loaded
    key = converted.key_for(Path(path), sha256)
    loaded = converted.load_converted(key, model_id, str(path), sha256, weights)
    if loaded is None:
        log.info("reading %s (once: an index of it is kept for later loads)", path)
        loaded = load_gguf(path, model_id=model_id, weights=weights)
        loaded.file_sha256 = sha256
        converted.save_converted(key, loaded)
    return loaded

"""GGUF files read once: their float32 weights as safetensors and their metadata as JSON,
under $TOKENWORKS_HOME/converted/, keyed by the file's sha256 (catalogue models) or by its
path, size and modification time (any other .gguf).

The gguf package builds a numpy view for every metadata string (the default model's
tokenizer holds 98,000 of them) and dequantises in numpy: seconds before the first token of
every `generate`. From the converted copy the same LoadedModel comes back in a fraction of
a second; the copy takes the float32 size on disk
(540 MB for the default model). TOKENWORKS_NO_CONVERTED=1 reads the GGUF every time.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import logging
import os
import shutil
import tempfile
from pathlib import Path

import numpy as np
import torch

from tokenworks.models.catalogue import home
from tokenworks.models.spec import MLASpec, ModelSpec, MoESpec, RopeScaling

log = logging.getLogger(__name__)
FORMAT = 1  # bump when what is stored changes: older copies are then rebuilt
_EXTRA = "__extra__."  # weights-file prefix of spec.extra arrays (e.g. rope_freqs)


def key_for(path: Path, sha256: str | None) -> str:
    if sha256:
        return sha256[:32]
    st = path.stat()
    ident = f"{path.resolve()}\0{st.st_size}\0{st.st_mtime_ns}"
    return "path-" + hashlib.sha256(ident.encode()).hexdigest()[:32]


def _dir(key: str) -> Path:
    return home() / "converted" / key


def enabled() -> bool:
    return os.environ.get("TOKENWORKS_NO_CONVERTED", "") in ("", "0")


def load_converted(
    key: str, model_id: str, file_path: str, sha256: str | None, weights: bool = True
):
    """The LoadedModel of a converted copy, or None where there is none (or it is stale);
    weights=False reads only the spec's own tensors (`weights` is empty)."""
    from safetensors import safe_open
    from safetensors.torch import load_file

    from tokenworks.models.loader import LoadedModel

    d = _dir(key)
    try:
        meta = json.loads((d / "meta.json").read_text())
        if meta.get("format") != FORMAT:
            return None
        if weights:
            tensors = load_file(d / "weights.safetensors")
        else:
            with safe_open(d / "weights.safetensors", framework="pt") as f:
                tensors = {k: f.get_tensor(k) for k in f.keys() if k.startswith(_EXTRA)}
    except (OSError, ValueError) as e:
        if (d / "meta.json").exists():
            log.warning("the converted copy in %s is unreadable (%s); reading the GGUF", d, e)
        return None
    s = meta["spec"]
    extra = {
        k[len(_EXTRA) :]: tensors.pop(k).numpy() for k in list(tensors) if k.startswith(_EXTRA)
    }
    rope = s.pop("rope_scaling", None)
    moe, mla = s.pop("moe", None), s.pop("mla", None)
    if s.get("window_layers") is not None:
        s["window_layers"] = tuple(s["window_layers"])
    if moe:
        moe = MoESpec(**moe | {"dense_layers": tuple(moe["dense_layers"])})
    spec = ModelSpec(
        **s | {"eos_token_ids": tuple(s["eos_token_ids"]), "extra": s["extra"] | extra},
        rope_scaling=RopeScaling(**rope) if rope else None,
        moe=moe,
        mla=MLASpec(**mla) if mla else None,
    )
    return LoadedModel(
        spec=spec,
        weights=tensors,
        tokenizer_source=meta["tokenizer_source"],
        chat_template=meta["chat_template"],
        model_id=model_id,
        file_sha256=sha256,
        file_path=file_path,
    )


def save_converted(key: str, loaded) -> None:
    """Write loaded's converted copy (whole or not at all); a failure only logs."""
    from safetensors.torch import save_file

    d = _dir(key)
    spec = dataclasses.asdict(loaded.spec)
    arrays = {k: v for k, v in spec["extra"].items() if isinstance(v, np.ndarray)}
    spec["extra"] = {k: v for k, v in spec["extra"].items() if k not in arrays}
    tensors = {**loaded.weights}
    tensors.update(
        {_EXTRA + k: torch.from_numpy(np.ascontiguousarray(v)) for k, v in arrays.items()}
    )
    meta = {
        "format": FORMAT,
        "source": loaded.file_path,
        "spec": spec,
        "tokenizer_source": loaded.tokenizer_source,
        "chat_template": loaded.chat_template,
    }
    try:
        d.parent.mkdir(parents=True, exist_ok=True)
        tmp = Path(tempfile.mkdtemp(dir=d.parent, prefix=f".{key}-"))
        try:
            save_file({k: t.contiguous() for k, t in tensors.items()}, tmp / "weights.safetensors")
            (tmp / "meta.json").write_text(json.dumps(meta))
            shutil.rmtree(d, ignore_errors=True)
            os.replace(tmp, d)  # atomic: a reader sees the whole copy or none
        finally:
            shutil.rmtree(tmp, ignore_errors=True)
    except (OSError, TypeError, ValueError) as e:
        log.warning("could not keep a converted copy of %s (%s)", loaded.file_path, e)

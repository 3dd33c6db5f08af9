"""An index of each GGUF file read, kept under $TOKENWORKS_HOME/converted/, keyed by the
file's sha256 (catalogue models) or by its path, size and modification time (any other
.gguf).

The gguf package builds a numpy view for every metadata string (the default model's
tokenizer holds 98,000 of them): seconds before the first token of every `generate`. The
index holds what that reading gives (the spec, the tokenizer's fields, the chat template)
and where each tensor lies in the file, as JSON; a later load reads it and maps the file's
tensors as they are stored (models/gguf_file.gguf_weights). No copy of the weights is kept.
EngineConfig.keep_gguf_index off (--no-keep-gguf-index) reads the GGUF every time.
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

from tokenworks.models.catalogue import home
from tokenworks.models.gguf_file import GGUFIndex, StoredTensor, rope_frequencies
from tokenworks.models.loaded import LoadedModel
from tokenworks.models.spec import MLASpec, ModelSpec, MoESpec, QueryTemperature, RopeScaling

log = logging.getLogger(__name__)
FORMAT = 6  # bump when what is stored changes: older copies are then rebuilt


def key_for(path: Path, sha256: str | None) -> str:
    if sha256:
        return sha256[:32]
    st = path.stat()
    ident = f"{path.resolve()}\0{st.st_size}\0{st.st_mtime_ns}"
    return "path-" + hashlib.sha256(ident.encode()).hexdigest()[:32]


def _dir(key: str) -> Path:
    return home() / "converted" / key


def load_converted(
    key: str, model_id: str, file_path: str, sha256: str | None, weights: bool = True
):
    """The LoadedModel of a kept index, or None where there is none (or it is stale);
    weights=False maps no tensor but RoPE's frequencies (`weights` is empty)."""
    d = _dir(key)
    try:
        meta = json.loads((d / "meta.json").read_text())
        if meta.get("format") != FORMAT:
            return None
        index = GGUFIndex(meta["arch"], [StoredTensor(*t) for t in meta["tensors"]])
        for t in index.tensors:
            object.__setattr__(t, "shape", tuple(t.shape))
    except (OSError, ValueError, KeyError, TypeError) as e:
        if (d / "meta.json").exists():
            log.warning("the index in %s is unreadable (%s); reading the GGUF", d, e)
        return None
    s = meta["spec"]
    rope = s.pop("rope_scaling", None)
    moe, mla = s.pop("moe", None), s.pop("mla", None)
    temperature = s.pop("query_temperature", None)
    for name in ("window_layers", "nope_layers"):  # JSON's lists back to tuples
        if s.get(name) is not None:
            s[name] = tuple(s[name])
    if moe:
        moe = MoESpec(**moe | {"dense_layers": tuple(moe["dense_layers"])})
    path = Path(file_path)
    freqs = rope_frequencies(path, index.tensors)
    extra = {"rope_freqs": freqs} if freqs is not None else {}
    spec = ModelSpec(
        **s | {"eos_token_ids": tuple(s["eos_token_ids"]), "extra": s["extra"] | extra},
        rope_scaling=RopeScaling(**rope) if rope else None,
        moe=moe,
        mla=MLASpec(**mla) if mla else None,
        query_temperature=QueryTemperature(**temperature) if temperature else None,
    )
    return LoadedModel(
        spec=spec,
        weights=index.weights(path, spec) if weights else {},
        tokenizer_source=meta["tokenizer_source"],
        chat_template=meta["chat_template"],
        model_id=model_id,
        file_sha256=sha256,
        file_path=file_path,
        gguf_index=index,
    )


def save_converted(key: str, loaded) -> None:
    """Write loaded's index (whole or not at all); a failure only logs."""
    d = _dir(key)
    spec = dataclasses.asdict(loaded.spec)
    spec["extra"] = {k: v for k, v in spec["extra"].items() if not isinstance(v, np.ndarray)}
    index = loaded.gguf_index
    meta = {
        "format": FORMAT,
        "source": loaded.file_path,
        "spec": spec,
        "tokenizer_source": loaded.tokenizer_source,
        "chat_template": loaded.chat_template,
        "arch": index.arch,
        "tensors": [dataclasses.astuple(t) for t in index.tensors],
    }
    try:
        d.parent.mkdir(parents=True, exist_ok=True)
        tmp = Path(tempfile.mkdtemp(dir=d.parent, prefix=f".{key}-"))
        try:
            (tmp / "meta.json").write_text(json.dumps(meta))
            shutil.rmtree(d, ignore_errors=True)
            os.replace(tmp, d)  # atomic: a reader sees the whole index or none
        finally:
            shutil.rmtree(tmp, ignore_errors=True)
    except (OSError, TypeError, ValueError) as e:
        log.warning("could not keep an index of %s (%s)", loaded.file_path, e)

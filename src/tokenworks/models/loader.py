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

import json
import logging
import mmap
import re
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
from tqdm import tqdm

from tokenworks.models import arch as arch_registry
from tokenworks.models import catalogue
from tokenworks.models.spec import ModelSpec, RopeScaling
from tokenworks.shapes import from_hf_config

log = logging.getLogger(__name__)


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


def load(model: str, weights: bool = True) -> LoadedModel:
    """Resolve a model argument to weights and a spec (see the module docstring).

    weights=False reads only the spec, tokenizer and chat template (`weights` is empty):
    what a process that tokenises for an engine elsewhere needs, at a fraction of the
    memory and time."""
    if model == "toy":
        from tokenworks.models.toy import load_toy

        return load_toy()
    if model in catalogue.CATALOGUE:
        entry = catalogue.lookup(model)
        path = catalogue.pull(model)
        loaded = load_gguf_once(path, model, entry.sha256, weights)
        loaded.chat_template = loaded.chat_template or entry.chat_template
        return loaded
    path = Path(model).expanduser()
    if path.is_file():
        if path.suffix != ".gguf":
            raise ModelLoadError(f"{path} is a file but not a .gguf; pass a .gguf or a directory")
        return load_gguf_once(path, model, weights=weights)
    if path.is_dir():
        return load_hf_dir(path, model_id=model, weights=weights)
    if re.fullmatch(r"[\w.-]+/[\w.-]+", model) and not model.startswith((".", "/")):
        return load_hf_dir(_fetch_from_hub(model), model_id=model, weights=weights)
    catalogue.lookup(model)  # raises ModelNotFoundError naming the choices
    raise AssertionError("unreachable")


# --------------------------------------------------------------------------- GGUF


def _field(reader, key: str, default=None):
    f = reader.fields.get(key)
    if f is None:
        return default
    return f.contents()


def _unpermute(w: np.ndarray, n_head: int) -> np.ndarray:
    """Undo llama.cpp's Q/K row interleaving so rotate-half RoPE applies (see MODELS.md)."""
    rows, dim = w.shape
    return w.reshape(n_head, rows // n_head // 2, 2, dim).swapaxes(1, 2).reshape(rows, dim)


_GGUF_NAMES = {
    "token_embd.weight": "model.embed_tokens.weight",
    "output_norm.weight": "model.norm.weight",
    "output.weight": "lm_head.weight",
}


def _hf_name(gguf_name: str, fam, path: Path, arch: str) -> str:
    """A GGUF weight's Hugging Face name (blk.N.* through the family's table)."""
    name = _GGUF_NAMES.get(gguf_name)
    if name is not None:
        return name
    m = re.fullmatch(r"blk\.(\d+)\.(.+)", gguf_name)
    if not m or m.group(2) not in fam.gguf_block:
        raise ModelLoadError(f"{path}: unexpected tensor {gguf_name} for {arch}")
    return f"model.layers.{m.group(1)}.{fam.gguf_block[m.group(2)]}"


def load_gguf_once(
    path: Path, model_id: str, sha256: str | None = None, weights: bool = True
) -> LoadedModel:
    """load_gguf, from the index kept of the file where there is one (models/converted.py)."""
    from tokenworks.models import converted

    if not converted.enabled():
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


@dataclass(frozen=True)
class StoredTensor:
    """Where a tensor lies in a GGUF file: its type, shape (ggml's order: the row first)
    and its bytes' absolute offset."""

    name: str
    ggml_type: int
    shape: tuple[int, ...]
    offset: int
    nbytes: int


def _stored_tensors(reader, path: Path) -> list[StoredTensor]:
    import gguf

    out = []
    for t in reader.tensors:
        expected = (
            int(np.prod(t.shape))
            * gguf.GGML_QUANT_SIZES[t.tensor_type][1]
            // (gguf.GGML_QUANT_SIZES[t.tensor_type][0])
        )
        if t.data.nbytes != expected or t.data_offset + expected > path.stat().st_size:
            raise ModelLoadError(f"{path}: tensor {t.name} is truncated; download the file again")
        shape = tuple(int(d) for d in t.shape)
        out.append(StoredTensor(t.name, int(t.tensor_type), shape, int(t.data_offset), expected))
    return out


def _dense_array(mm: np.ndarray, t: StoredTensor) -> np.ndarray:
    """An F32 / F16 / BF16 tensor's values as float32 [torch order]."""
    import gguf

    raw = mm[t.offset : t.offset + t.nbytes]
    shape = tuple(reversed(t.shape))
    if t.ggml_type == gguf.GGMLQuantizationType.F32:
        return np.array(raw.view(np.float32).reshape(shape))
    if t.ggml_type == gguf.GGMLQuantizationType.F16:
        return raw.view(np.float16).reshape(shape).astype(np.float32)
    if t.ggml_type == gguf.GGMLQuantizationType.BF16:
        return (raw.view(np.uint16).astype(np.uint32) << 16).view(np.float32).reshape(shape)
    return gguf.quants.dequantize(np.asarray(raw), t.ggml_type).reshape(shape).astype(np.float32)


def _release(mm: np.memmap, offset: int, nbytes: int) -> None:
    """Drop the mapped pages wholly inside [offset, offset + nbytes) from this process
    (clean file pages: read again from the file should they be touched), so a tensor that
    was copied does not count twice in the resident set."""
    page = mmap.PAGESIZE
    start, stop = -(-offset // page) * page, (offset + nbytes) // page * page
    if stop > start and hasattr(mm._mmap, "madvise"):
        mm._mmap.madvise(mmap.MADV_DONTNEED, start, stop - start)


def gguf_weights(
    path: Path, tensors: list[StoredTensor], arch: str, n_heads: int, n_kv: int,
    names_only: bool = False,
) -> tuple[dict, np.ndarray | None]:  # fmt: skip
    """The weights under Hugging Face names, read from the memory-mapped file: matrices of
    quantised types as BlockTensors (views of the file, executed as stored; llama's Q and K
    rows reordered, a copy), the rest as float32 tensors; and RoPE's frequencies, if the file
    has them. names_only: the names with None for every weight (no matrix is touched)."""
    from tokenworks.kernels import blocks

    fam = arch_registry.for_gguf_arch(arch)
    mm = np.memmap(path, dtype=np.uint8, mode="c")  # copy-on-write: pages shared, never written
    weights: dict = {}
    rope_freqs = None
    bar = tqdm(tensors, desc=f"map {path.name}", unit="tensor", leave=False, disable=names_only)
    for t in bar:
        if t.name == "rope_freqs.weight":
            rope_freqs = _dense_array(mm, t)
            continue
        name = _hf_name(t.name, fam, path, arch)
        experts = "{e}" in name  # one 3-D tensor holds every expert's matrix: [E, out, in]
        n_exp = t.shape[2] if experts else 1
        if names_only:
            weights.update({name.format(e=e): None for e in range(n_exp)})
            continue
        heads = None
        if arch == "llama" and t.name.endswith(("attn_q.weight", "attn_q.bias")):
            heads = n_heads
        elif arch == "llama" and t.name.endswith(("attn_k.weight", "attn_k.bias")):
            heads = n_kv
        if len(t.shape) >= 2 and t.ggml_type not in blocks.DENSE:
            rows = int(np.prod(t.shape[1:]))
            raw = mm[t.offset : t.offset + t.nbytes].reshape(rows, -1)
            w = blocks.executable(t.ggml_type, (rows, t.shape[0]), raw)
            if heads:
                w = w.rows(torch.from_numpy(_unpermute(np.arange(rows)[:, None], heads).ravel()))
                _release(mm, t.offset, t.nbytes)  # copied: the mapped pages are not needed
            if experts:
                per = rows // n_exp
                for e in range(n_exp):
                    weights[name.format(e=e)] = w.rows(slice(e * per, (e + 1) * per))
                continue
            weights[name] = w
            continue
        arr = _dense_array(mm, t)
        if heads:
            arr = _unpermute(arr if arr.ndim == 2 else arr[:, None], heads).reshape(arr.shape)
        if experts:
            for e, part in enumerate(arr):
                weights[name.format(e=e)] = torch.from_numpy(np.array(part, dtype=np.float32))
            continue
        weights[name] = torch.from_numpy(np.array(arr, dtype=np.float32))  # owned, writable
    return weights, rope_freqs


def load_gguf(path: Path, model_id: str | None = None, weights: bool = True) -> LoadedModel:
    """A GGUF file's spec, tokenizer and weights as stored (gguf_weights); weights=False
    skips the weights (only their names are read)."""
    import gguf

    path = Path(path)
    try:
        reader = gguf.GGUFReader(path)
    except Exception as e:  # the gguf package raises ValueError/IndexError/struct errors
        raise ModelLoadError(
            f"{path} is not a readable GGUF file ({type(e).__name__}: {e}); it may be truncated "
            "or corrupt: download it again"
        ) from e
    arch = _field(reader, "general.architecture")
    try:
        fam = arch_registry.for_gguf_arch(arch)
    except arch_registry.UnknownArchitectureError as e:
        raise ModelLoadError(f"{path}: {e}") from None
    n_heads = int(_field(reader, f"{arch}.attention.head_count"))
    n_kv = int(_field(reader, f"{arch}.attention.head_count_kv", n_heads))
    hidden = int(_field(reader, f"{arch}.embedding_length"))
    tokens = reader.fields.get("tokenizer.ggml.tokens")
    vocab = int(_field(reader, f"{arch}.vocab_size", len(tokens.data) if tokens else 0))
    eos = _field(reader, "tokenizer.ggml.eos_token_id")
    eot = _field(reader, "tokenizer.ggml.eot_token_id")
    eos_ids = tuple(sorted({int(x) for x in (eos, eot) if x is not None}))

    stored = _stored_tensors(reader, path)
    names, rope_freqs = gguf_weights(path, stored, arch, n_heads, n_kv, names_only=True)
    kw = dict(
        arch=fam.name,
        vocab_size=vocab,
        hidden_size=hidden,
        n_layers=int(_field(reader, f"{arch}.block_count")),
        n_heads=n_heads,
        n_kv_heads=n_kv,
        head_dim=int(
            _field(reader, f"{arch}.attention.key_length")
            or _field(reader, f"{arch}.rope.dimension_count", hidden // n_heads)
        ),
        intermediate_size=int(_field(reader, f"{arch}.feed_forward_length", 0)),
        max_position=int(_field(reader, f"{arch}.context_length")),
        norm_eps=float(_field(reader, f"{arch}.attention.layer_norm_rms_epsilon")),
        rope_theta=float(_field(reader, f"{arch}.rope.freq_base", 10000.0)),
        tie_embeddings="lm_head.weight" not in names,
        qkv_bias="model.layers.0.self_attn.q_proj.bias" in names,
        sliding_window=_field(reader, f"{arch}.attention.sliding_window"),
        bos_token_id=_field(reader, "tokenizer.ggml.bos_token_id"),
        eos_token_ids=eos_ids,
        name=str(_field(reader, "general.name", path.stem)),
        source=f"gguf:{path.name}",
        extra={"rope_freqs": rope_freqs} if rope_freqs is not None else {},
    )
    extra = fam.gguf_fields(lambda key, default=None: _field(reader, key, default), arch)
    # stop tokens the family knows of beyond the file's EOS (Gemma's <end_of_turn>)
    kw["eos_token_ids"] = tuple(sorted(set(eos_ids) | set(extra.pop("stop_token_ids", ()))))
    spec = ModelSpec(**kw | extra)
    # scores only where they rank merges (SentencePiece; Gemma ranks by position)
    keep_scores = _field(reader, "tokenizer.ggml.model") == "llama" and fam.name != "gemma3"
    fields = {
        k: _field(reader, k)
        for k in reader.fields
        if k.startswith("tokenizer.ggml.") and (k != "tokenizer.ggml.scores" or keep_scores)
    }
    chat_template = _field(reader, "tokenizer.chat_template")
    index = GGUFIndex(arch, stored)
    return LoadedModel(
        spec=spec,
        weights=index.weights(path, spec) if weights else {},
        tokenizer_source={"kind": "gguf", "fields": fields},
        chat_template=chat_template,
        model_id=model_id or str(path),
        file_sha256=None,
        file_path=str(path),
        gguf_index=index,
    )


@dataclass(frozen=True)
class GGUFIndex:
    """What loading a GGUF's weights needs beyond its spec: its architecture's name in the
    file and where each tensor lies (kept on disk by models/converted.py)."""

    arch: str
    tensors: list[StoredTensor]

    def weights(self, path: Path, spec: ModelSpec) -> dict:
        return gguf_weights(Path(path), self.tensors, self.arch, spec.n_heads, spec.n_kv_heads)[0]


# --------------------------------------------------------------------------- HF directory


def spec_from_hf_config(cfg: dict, source: str = "") -> ModelSpec:
    """Read a transformers config.json into a ModelSpec: the shape through
    shapes.from_hf_config (as the planners read it), RoPE and special tokens here."""
    mtype = cfg.get("model_type")
    eos = cfg.get("eos_token_id")
    eos_ids = tuple(eos) if isinstance(eos, list) else ((eos,) if eos is not None else ())
    try:
        fam = arch_registry.for_hf_model_type(mtype)
        shape = from_hf_config(cfg, cfg.get("_name_or_path", mtype))
        fields = fam.spec_fields(cfg)
    except (KeyError, ValueError) as e:
        raise ModelLoadError(f"{source or 'config.json'}: {e}") from e
    dims = dict(
        vocab_size=shape.vocab, hidden_size=shape.hidden, n_layers=shape.n_layers,
        n_heads=shape.n_heads, n_kv_heads=shape.n_kv_heads, head_dim=shape.head_dim,
        intermediate_size=shape.intermediate,
    )  # fmt: skip
    if mtype == "gpt2":
        return ModelSpec(
            arch="gpt2",
            **dims,
            max_position=cfg["n_positions"],
            norm_eps=cfg.get("layer_norm_epsilon", 1e-5),
            tie_embeddings=True,
            bos_token_id=cfg.get("bos_token_id"),
            eos_token_ids=eos_ids,
            name=cfg.get("_name_or_path", "gpt2"),
            source=source,
        )
    rs = cfg.get("rope_scaling") or cfg.get("rope_parameters") or {}
    if "full_attention" in rs:  # per layer type (Gemma 3): the family reads both
        rs = rs["full_attention"]
    rope_theta = cfg.get("rope_theta", rs.get("rope_theta", 10000.0))
    try:
        scaling = rope_scaling(rs, cfg.get("max_position_embeddings", 2048))
    except (KeyError, ValueError) as e:
        raise ModelLoadError(f"{source or 'config.json'}: rope scaling {rs!r}: {e}") from e
    max_position = cfg.get("max_position_embeddings", 2048)
    if scaling is not None and scaling.extends_context:
        max_position = max(max_position, scaling.context)
    # a window only where the model uses it (Qwen2 configs carry one they switch off)
    window = shape.sliding_window if mtype == "mistral" or cfg.get("use_sliding_window") else None
    kw = dims | dict(
        arch=fam.name,
        max_position=max_position,
        norm_eps=cfg.get("rms_norm_eps", 1e-6),
        rope_theta=float(rope_theta),
        rope_scaling=scaling,
        tie_embeddings=shape.tie_embeddings,
        qkv_bias=shape.qkv_bias,
        sliding_window=window,
        bos_token_id=cfg.get("bos_token_id"),
        eos_token_ids=eos_ids,
        name=cfg.get("_name_or_path", mtype),
        source=source,
    )
    return ModelSpec(**kw | fields)  # the family's fields over the shared ones


def rope_scaling(rs: dict, max_position: int) -> RopeScaling | None:
    """A config's rope_scaling / rope_parameters as a RopeScaling (None: plain RoPE)."""
    kind = rs.get("rope_type", rs.get("type"))
    if kind in (None, "default"):
        return None
    if kind == "llama3":
        return RopeScaling(
            factor=rs["factor"],
            low_freq_factor=rs["low_freq_factor"],
            high_freq_factor=rs["high_freq_factor"],
            original_max_position=rs["original_max_position_embeddings"],
        )
    if kind in ("linear", "dynamic"):
        return RopeScaling(
            factor=float(rs["factor"]), original_max_position=max_position, kind=kind
        )
    if kind == "yarn":
        return RopeScaling(
            factor=float(rs["factor"]),
            original_max_position=rs.get("original_max_position_embeddings") or max_position,
            kind="yarn",
            beta_fast=float(rs.get("beta_fast") or 32),
            beta_slow=float(rs.get("beta_slow") or 1),
            attention_factor=rs.get("attention_factor"),
            mscale=rs.get("mscale"),
            mscale_all_dim=rs.get("mscale_all_dim"),
            truncate=bool(rs.get("truncate", True)),
        )
    raise ValueError(f"{kind!r} is not supported (llama3, linear, dynamic and yarn are)")


def load_hf_dir(path: Path, model_id: str | None = None, weights: bool = True) -> LoadedModel:
    from safetensors.torch import load_file

    path = Path(path)
    cfg_path = path / "config.json"
    if not cfg_path.exists():
        raise ModelLoadError(f"{path} has no config.json; is it a Hugging Face model directory?")
    cfg = json.loads(cfg_path.read_text())
    files = sorted(path.glob("*.safetensors"))
    if not files:
        raise ModelLoadError(
            f"{path} has no *.safetensors files (pickled .bin weights are not loaded, for "
            "safety); convert them with `save_pretrained(..., safe_serialization=True)`"
        )
    spec = spec_from_hf_config(cfg, source=f"hf:{path.name}")
    fam = arch_registry.family(spec.arch)
    want_weights, weights = weights, {}
    for f in files if want_weights else []:
        weights.update({fam.rename(k): v.float() for k, v in load_file(f).items()})
    if want_weights:
        weights = fam.prepare(weights, spec)
    tok_json = path / "tokenizer.json"
    chat_template = None
    tc_path = path / "tokenizer_config.json"
    if tc_path.exists():
        chat_template = json.loads(tc_path.read_text()).get("chat_template")
    if (path / "chat_template.jinja").exists():
        chat_template = (path / "chat_template.jinja").read_text()
    return LoadedModel(
        spec=spec,
        weights=weights,
        tokenizer_source={"kind": "json", "path": str(tok_json)} if tok_json.exists() else {},
        chat_template=chat_template,
        model_id=model_id or str(path),
        file_sha256=None,
        file_path=str(path),
    )


def _fetch_from_hub(repo_id: str) -> Path:
    try:
        from huggingface_hub import snapshot_download
    except ImportError:
        raise ModelLoadError(
            f"{repo_id!r} looks like a hub id, but huggingface_hub is not installed: "
            "`pip install 'tokenworks[hub]'`, or download the files yourself and pass the "
            "directory (config.json, *.safetensors, tokenizer.json)"
        ) from None
    try:
        return Path(
            snapshot_download(
                repo_id,
                allow_patterns=["*.json", "*.safetensors", "*.jinja", "tokenizer*"],
            )
        )
    except Exception as e:
        raise ModelLoadError(
            f"could not fetch {repo_id!r} from the hub ({type(e).__name__}: {e}). Without "
            "network access, download config.json, *.safetensors and tokenizer.json on another "
            f"machine and pass their directory, or use a catalogue model: "
            f"{', '.join(catalogue.CATALOGUE)}"
        ) from e

"""A GGUF file read with the `gguf` package: its spec, tokenizer fields and chat template,
and its tensors memory-mapped as stored (quantised matrices kept as the file's blocks,
llama.cpp's Q/K row interleaving undone) under Hugging Face names."""

from __future__ import annotations

import logging
import re
from dataclasses import dataclass
from pathlib import Path

import numpy as np
from tqdm import tqdm

from tokenworks.models import arch as arch_registry
from tokenworks.models import gguf_keys
from tokenworks.models.loaded import LoadedModel, ModelLoadError
from tokenworks.models.spec import ModelSpec

log = logging.getLogger(__name__)


# the architectures whose converter (convert_hf_to_gguf.py's LlamaModel and the classes
# built on it) writes Q and K rows in the order llama.cpp's interleaved RoPE reads
PERMUTED_QK = ("llama", "smollm3", "granite", "granitemoe", "mistral3", "llama4")


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


# tensors that ask for what is not built, and what that is
_REFUSED_TENSORS = {
    "rope_factors_long.weight": "LongRoPE scaling (Phi-3 128k, Phi-3.5) is not built",
    "rope_factors_short.weight": "LongRoPE scaling (Phi-3 128k, Phi-3.5) is not built",
}


def _hf_names(gguf_name: str, fam, path: Path, arch: str) -> tuple[str, ...]:
    """A GGUF weight's Hugging Face names (blk.N.* through the family's table): one, or
    several for a tensor that stacks them by rows."""
    name = _GGUF_NAMES.get(gguf_name)
    if name is not None:
        return (name,)
    if gguf_name in _REFUSED_TENSORS:
        raise ModelLoadError(f"{path}: tensor {gguf_name}: {_REFUSED_TENSORS[gguf_name]}")
    m = re.fullmatch(r"blk\.(\d+)\.(.+)", gguf_name)
    if not m or m.group(2) not in fam.gguf_block:
        raise ModelLoadError(f"{path}: unexpected tensor {gguf_name} for {arch}")
    names = fam.gguf_block[m.group(2)]
    names = (names,) if isinstance(names, str) else names
    return tuple(f"model.layers.{m.group(1)}.{n}" for n in names)


def _share(name: str, n_heads: int, n_kv: int) -> int:
    """A stacked weight's share of its tensor's rows: Q's by the query heads, K's and V's by
    the key/value heads, the gate's and up's alike."""
    if ".q_proj." in name:
        return n_heads
    return n_kv if (".k_proj." in name or ".v_proj." in name) else 1


def _parts(names: tuple[str, ...], rows: int, n_heads: int, n_kv: int, n_exp: int) -> list:
    """(name, rows) of each weight in a tensor of `rows` rows: the whole for one name, an
    expert's slice for each of n_exp experts ("{e}" in the name), stacked weights by their
    shares (_share)."""
    if "{e}" in names[0]:
        per = rows // n_exp
        return [(names[0].format(e=e), slice(e * per, (e + 1) * per)) for e in range(n_exp)]
    if len(names) == 1:
        return [(names[0], slice(None))]
    shares = [_share(n, n_heads, n_kv) for n in names]
    unit, start, out = rows // sum(shares), 0, []
    for name, share in zip(names, shares, strict=True):
        out.append((name, slice(start, start + share * unit)))
        start += share * unit
    return out


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


def gguf_weights(
    path: Path, tensors: list[StoredTensor], arch: str, n_heads: int, n_kv: int,
    names_only: bool = False,
) -> tuple[dict, np.ndarray | None]:  # fmt: skip
    """The weights under Hugging Face names, read from the memory-mapped file: matrices of
    quantised types as BlockTensors (views of the file, executed as stored; llama's Q and K
    rows reordered, a copy), the rest as float32 tensors; and RoPE's frequencies, if the file
    has them. names_only: the names with None for every weight (no matrix is touched)."""
    if not names_only:  # (a spec and tokenizer alone need neither torch nor the kernels)
        import torch

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
        names = _hf_names(t.name, fam, path, arch)
        # experts: one 3-D tensor holds every expert's matrix, [E, out, in] (one 2-D
        # tensor every expert's bias, [E, out])
        n_exp = t.shape[-1] if "{e}" in names[0] else 1
        rows = int(np.prod(t.shape[1:])) if len(t.shape) >= 2 else t.shape[0]
        parts = _parts(names, rows, n_heads, n_kv, n_exp)
        if names_only:
            weights.update({name: None for name, _ in parts})
            continue
        heads = None
        if arch in PERMUTED_QK and t.name.endswith(("attn_q.weight", "attn_q.bias")):
            heads = n_heads
        elif arch in PERMUTED_QK and t.name.endswith(("attn_k.weight", "attn_k.bias")):
            heads = n_kv
        vectors = n_exp > 1 and len(t.shape) == 2  # every expert's bias: read as floats
        if len(t.shape) >= 2 and t.ggml_type not in blocks.DENSE and not vectors:
            raw = mm[t.offset : t.offset + t.nbytes].reshape(rows, -1)
            w = blocks.executable(t.ggml_type, (rows, t.shape[0]), raw)
            if heads:
                w = w.rows(torch.from_numpy(_unpermute(np.arange(rows)[:, None], heads).ravel()))
                blocks.release_pages(torch.from_numpy(raw))  # copied: pages not needed
            for name, part in parts:  # a slice of rows stays a view of the file
                weights[name] = w if part == slice(None) else w.rows(part)
            continue
        arr = _dense_array(mm, t)
        if heads:
            arr = _unpermute(arr if arr.ndim == 2 else arr[:, None], heads).reshape(arr.shape)
        flat = arr.reshape(rows, -1) if arr.ndim > 2 else arr
        for name, part in parts:  # owned, writable
            value = flat[part][0] if vectors else flat[part]
            weights[name] = torch.from_numpy(np.array(value, dtype=np.float32))
    if not names_only:  # the dense reads copied their values: drop the file pages they
        blocks.release_pages(torch.from_numpy(mm))  # mapped (the kernel maps whole folios)
    return weights, rope_freqs


def _short(value) -> str:
    text = repr(value)
    return text if len(text) <= 60 else text[:57] + "..."


def _expected_shapes(spec: ModelSpec) -> dict[str, tuple[tuple[int, ...], str]]:
    """Tensor name (blk.N. cut off) -> its shape in ggml's order (the row first) as the
    metadata implies it, and the keys that imply it."""
    h, q, kv = spec.hidden_size, spec.n_heads * spec.head_dim, spec.n_kv_heads * spec.head_dim
    o = spec.n_heads * spec.mla.v_head_dim if spec.mla else q  # attention's output width
    heads = "embedding_length, attention.head_count, attention.key_length"
    kv_heads = "embedding_length, attention.head_count_kv, attention.key_length"
    shapes = {
        "token_embd.weight": ((h, spec.vocab_size), "embedding_length, vocab_size"),
        "output.weight": ((h, spec.vocab_size), "embedding_length, vocab_size"),
        "output_norm.weight": ((h,), "embedding_length"),
        "attn_norm.weight": ((h,), "embedding_length"),
        "attn_q.weight": ((h, q), heads),
        "attn_k.weight": ((h, kv), kv_heads),
        "attn_v.weight": ((h, kv), kv_heads),
        "attn_output.weight": ((o, h), heads),
    }
    ff = "embedding_length, feed_forward_length"
    i = spec.intermediate_size
    if i:
        shapes |= {"ffn_gate.weight": ((h, i), ff), "ffn_up.weight": ((h, i), ff),
                   "ffn_down.weight": ((i, h), ff)}  # fmt: skip
    rows = {"q_proj": q, "k_proj": kv, "v_proj": kv, "gate_proj": i, "up_proj": i}
    for tensor, names in arch_registry.family(spec.arch).gguf_block.items():
        if not isinstance(names, str):  # weights stacked by rows (Phi-3's attn_qkv, ffn_up)
            n = sum(rows[name.split(".")[-2]] for name in names)
            keys = f"{heads}, attention.head_count_kv" if tensor.startswith("attn") else ff
            shapes[tensor] = ((h, n), keys)
    return shapes


def check_shapes(path: Path, tensors: list[StoredTensor], spec: ModelSpec) -> None:
    """Every tensor whose shape the metadata fixes has that shape, and every block's number
    is a layer the metadata counts: a file that disagrees with itself is refused by name."""
    expected = _expected_shapes(spec)
    for t in tensors:
        name = t.name
        if name.startswith("blk."):
            number, _, name = name[4:].partition(".")
            if not number.isdigit() or int(number) >= spec.n_layers:
                raise ModelLoadError(f"{path}: tensor {t.name} is past block_count = "
                                     f"{spec.n_layers}")  # fmt: skip
        want = expected.get(name)
        if want is not None and t.shape != want[0]:
            raise ModelLoadError(
                f"{path}: tensor {t.name} has shape {list(t.shape)}, but the metadata "
                f"({want[1]}) makes it {list(want[0])}"
            )


def rope_frequencies(path: Path, tensors: list[StoredTensor]) -> np.ndarray | None:
    """The file's RoPE frequencies (rope_freqs.weight), where it has them."""
    t = next((t for t in tensors if t.name == "rope_freqs.weight"), None)
    return None if t is None else _dense_array(np.memmap(path, dtype=np.uint8, mode="c"), t)


def open_reader(path: Path):
    """The gguf package's reader of path, or ModelLoadError naming the file."""
    import gguf

    try:
        return gguf.GGUFReader(path)
    except Exception as e:  # the gguf package raises ValueError/IndexError/struct errors
        raise ModelLoadError(
            f"{path} is not a readable GGUF file ({type(e).__name__}: {e}); it may be truncated "
            "or corrupt: download it again"
        ) from e


def load_gguf(
    path: Path, model_id: str | None = None, weights: bool = True, reader=None
) -> LoadedModel:
    """A GGUF file's spec, tokenizer and weights as stored (gguf_weights); weights=False
    skips the weights (only their names are read); reader: path's, already opened."""
    path = Path(path)
    reader = reader or open_reader(path)
    try:
        return _load_read(reader, path, model_id, weights)
    except ModelLoadError:
        raise
    except Exception as e:  # a value of the wrong type or size, a count past the file...
        raise ModelLoadError(
            f"{path}: its metadata cannot be read ({type(e).__name__}: {e}); the file may be "
            "corrupt: download it again"
        ) from e


def _load_read(reader, path: Path, model_id: str | None, weights: bool) -> LoadedModel:
    arch = _field(reader, "general.architecture")
    if not isinstance(arch, str):
        raise ModelLoadError(f"{path}: general.architecture is missing or not a string")
    try:
        fam = arch_registry.for_gguf_arch(arch)
    except arch_registry.UnknownArchitectureError as e:
        raise ModelLoadError(f"{path}: {e}") from None
    refusal = gguf_keys.first_refusal(lambda k: _field(reader, k), reader.fields, arch, fam)
    if refusal is not None:
        raise ModelLoadError(
            f"{path}: {refusal.key} = {_short(refusal.value)}: {refusal.why} "
            "(`tokenworks inspect` lists every key)"
        )

    def need(suffix: str, kind=int, default=None):
        value = _field(reader, f"{arch}.{suffix}", default)
        if value is None:
            raise ModelLoadError(f"{path}: {arch}.{suffix} is missing")
        try:
            return kind(value)
        except (TypeError, ValueError):
            raise ModelLoadError(f"{path}: {arch}.{suffix} = {_short(value)} is not a "
                                 f"{kind.__name__}") from None  # fmt: skip

    n_heads = need("attention.head_count")
    n_kv = need("attention.head_count_kv", default=n_heads)
    hidden = need("embedding_length")
    tokens = reader.fields.get("tokenizer.ggml.tokens")
    vocab = need("vocab_size", default=len(tokens.data) if tokens else None)
    eos = _field(reader, "tokenizer.ggml.eos_token_id")
    eot = _field(reader, "tokenizer.ggml.eot_token_id")
    eos_ids = tuple(sorted({int(x) for x in (eos, eot) if x is not None}))
    n_layers = need("block_count")  # (named before the family's fields read it too)
    extra = fam.gguf_fields(lambda key, default=None: _field(reader, key, default), arch)
    head_dim = extra.pop("head_dim", None)  # (latent attention's families say their own)
    if head_dim is None:
        rotated = need("rope.dimension_count", default=hidden // n_heads)
        head_dim = need("attention.key_length", default=rotated)
        for suffix in ("attention.value_length", "rope.dimension_count"):
            if need(suffix, default=head_dim) != head_dim:
                raise ModelLoadError(
                    f"{path}: {arch}.{suffix} = {need(suffix)} differs from the head dimension "
                    f"{head_dim}, which {fam.name} cannot run"
                )

    stored = _stored_tensors(reader, path)
    names, rope_freqs = gguf_weights(path, stored, arch, n_heads, n_kv, names_only=True)
    context = need("context_length")
    try:
        scaling = gguf_keys.rope_scaling(lambda k: _field(reader, k), arch, context)
    except ValueError as e:
        raise ModelLoadError(f"{path}: {e}") from None
    if scaling is not None and scaling.extends_context:
        context = max(context, scaling.context)
    kw = dict(
        arch=fam.name,
        vocab_size=vocab,
        hidden_size=hidden,
        n_layers=n_layers,
        n_heads=n_heads,
        n_kv_heads=n_kv,
        head_dim=head_dim,
        intermediate_size=need("feed_forward_length", default=0),
        max_position=context,
        norm_eps=need("attention.layer_norm_rms_epsilon", float),
        rope_theta=need("rope.freq_base", float, 10000.0),
        rope_scaling=scaling,
        tie_embeddings="lm_head.weight" not in names,
        qkv_bias="model.layers.0.self_attn.q_proj.bias" in names,
        # 0: no window, as llama.cpp reads it (the converter writes 0 for a Phi-3 without one)
        sliding_window=_field(reader, f"{arch}.attention.sliding_window") or None,
        bos_token_id=_field(reader, "tokenizer.ggml.bos_token_id"),
        eos_token_ids=eos_ids,
        name=str(_field(reader, "general.name", path.stem)),
        source=f"gguf:{path.name}",
        extra={"rope_freqs": rope_freqs} if rope_freqs is not None else {},
    )
    # stop tokens the family knows of beyond the file's EOS (Gemma's <end_of_turn>)
    kw["eos_token_ids"] = tuple(sorted(set(eos_ids) | set(extra.pop("stop_token_ids", ()))))
    try:
        spec = ModelSpec(**kw | extra)
    except ValueError as e:
        raise ModelLoadError(f"{path}: {e}") from None
    check_shapes(path, stored, spec)
    # scores only where they rank merges (SentencePiece; Gemma ranks by position)
    keep_scores = _field(reader, "tokenizer.ggml.model") == "llama" and not fam.name.startswith(
        "gemma"
    )
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
        w = gguf_weights(Path(path), self.tensors, self.arch, spec.n_heads, spec.n_kv_heads)[0]
        return arch_registry.for_gguf_arch(self.arch).gguf_prepare(w, spec)

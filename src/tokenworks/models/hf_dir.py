"""A Hugging Face model directory (config.json, *.safetensors, tokenizer.json), from disk or
fetched from the hub; and the config.json reader the GGUF path shares for RoPE scalings."""

from __future__ import annotations

import json
import logging
from pathlib import Path

from tokenworks.models import arch as arch_registry
from tokenworks.models import catalogue
from tokenworks.models.loaded import LoadedModel, ModelLoadError
from tokenworks.models.spec import ModelSpec, RopeScaling
from tokenworks.shapes import from_hf_config

log = logging.getLogger(__name__)


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


def fetch_from_hub(repo_id: str) -> Path:
    from huggingface_hub import snapshot_download

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

"""What each key of a GGUF file's metadata asks of the engine, and what tokenworks does
with it: read (into the spec, the tokenizer or the chat template), informational (names,
licences, counts of the file itself), or refused, with the reason. A key under the file's
architecture that is neither read nor known to be harmless is refused: a hyperparameter
left unread would run the model wrong without a word. `tokenworks inspect FILE` prints
this judgement for every key; the loader raises the first refusal. rope_scaling reads the
scaling keys it judges read into a RopeScaling, for the loader and for the families that
adjust it."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from tokenworks.models.spec import RopeScaling
from tokenworks.ops.rope_scaling import yarn_mscale

READ, INFO, REFUSED = "read", "informational", "refused"


@dataclass(frozen=True)
class KeyVerdict:
    key: str
    value: object
    action: str  # READ, INFO or REFUSED
    why: str


# `{arch}.` + suffix -> what the loader makes of it (models/gguf_file.py, arch/*.py)
ARCH_READ = {
    "context_length": "the trained context",
    "embedding_length": "the hidden size",
    "block_count": "the number of layers",
    "feed_forward_length": "the MLP's width",
    "vocab_size": "the vocabulary's size",
    "attention.head_count": "query heads",
    "attention.head_count_kv": "key/value heads",
    "attention.key_length": "the head dimension",
    "attention.value_length": "the value head dimension (equal to key_length)",
    "attention.layer_norm_rms_epsilon": "RMSNorm's epsilon",
    "attention.sliding_window": "the attention window",
    "rope.freq_base": "RoPE's base",
    "rope.dimension_count": "the dimensions RoPE rotates (the whole head)",
    "rope.scale_linear": "linear RoPE scaling (an older key)",
    "rope.scaling.type": "RoPE scaling: none, linear or yarn",
    "rope.scaling.factor": "RoPE scaling's factor",
    "rope.scaling.original_context_length": "the context before RoPE scaling",
    "rope.scaling.attn_factor": "YaRN's attention factor (times 0.1 ln(factor) + 1)",
    "rope.scaling.yarn_beta_fast": "YaRN's beta_fast",
    "rope.scaling.yarn_beta_slow": "YaRN's beta_slow",
    "expert_count": "experts in each MoE layer",
    "expert_used_count": "experts each token is routed to",
    "expert_feed_forward_length": "each expert's MLP width",
    "expert_weights_norm": "whether the top-k routing weights are renormalised",
}
ARCH_INFO = {
    "rope.scaling.finetuned": "whether the model was fine-tuned at the scaled context",
    "tensor_data_layout": "how the converter laid out tensors (the tensors say the same)",
}
# `{arch}.` + suffix -> (the value that asks for nothing, why another is refused)
ARCH_CHECKED = {
    "rope.scaling.alpha": (0.0, "NTK-alpha RoPE scaling is not built"),
    "rope.scaling.yarn_log_multiplier": (
        0.0,
        "YaRN's mscale_all_dim (DeepSeek) is not read from GGUF",
    ),  # fmt: skip
    "rope.scaling.yarn_ext_factor": (-1.0, "a YaRN extrapolation factor is not built"),
    "rope.scaling.yarn_attn_factor": (1.0, "a YaRN attention factor override is not built"),
    "expert_gating_func": (1, "only softmax routing (1) is read from GGUF"),
}
TOKENIZER_READ = {
    "tokenizer.ggml.model": "the tokenizer's kind (gpt2: byte-level BPE; llama: SentencePiece)",
    "tokenizer.ggml.pre": "the pre-tokenizer's name",
    "tokenizer.ggml.tokens": "the vocabulary",
    "tokenizer.ggml.token_type": "each token's type (normal, control, byte...)",
    "tokenizer.ggml.merges": "BPE merges",
    "tokenizer.ggml.scores": "SentencePiece scores (merge ranks)",
    "tokenizer.ggml.bos_token_id": "the BOS token",
    "tokenizer.ggml.eos_token_id": "the EOS token (a stop token)",
    "tokenizer.ggml.eot_token_id": "the end-of-turn token (a stop token)",
    "tokenizer.ggml.unknown_token_id": "the unknown token",
    "tokenizer.ggml.add_bos_token": "whether a prompt starts with BOS",
    "tokenizer.ggml.add_space_prefix": "whether SentencePiece adds a leading space",
    "tokenizer.chat_template": "the chat template (rendered sandboxed)",
}
TOKENIZER_CHECKED = {
    "tokenizer.ggml.add_eos_token": (False, "appending EOS to every prompt is not built"),
}
GENERAL_READ = {
    "general.architecture": "the model family",
    "general.name": "the model's name in logs and records",
}


def _equal(value, wanted) -> bool:
    try:
        return type(wanted)(value) == wanted
    except (TypeError, ValueError):
        return False


def _checked(key: str, value, quiet, why: str) -> KeyVerdict:
    """A key that passes at the value that asks for nothing and is refused at any other."""
    if _equal(value, quiet):
        return KeyVerdict(key, value, INFO, "asks for nothing")
    return KeyVerdict(key, value, REFUSED, why)


def _lookup(key: str, name: str, value, read: dict, info: dict, checked: dict):
    """The verdict the tables give `name` (a key, or its suffix after the architecture),
    or None where none of them names it."""
    if name in read:
        return KeyVerdict(key, value, READ, read[name])
    if name in info:
        return KeyVerdict(key, value, INFO, info[name])
    if name in checked:
        return _checked(key, value, *checked[name])
    return None


def judge(key: str, value, arch: str, family) -> KeyVerdict:
    """What tokenworks does with one key of a file whose architecture is `arch`, read by
    `family` (models/arch; None where no family reads it)."""
    top = _lookup(key, key, value, GENERAL_READ | TOKENIZER_READ, {}, TOKENIZER_CHECKED)
    if top is not None:
        return top
    if key.startswith(f"{arch}."):
        if family is None:
            return KeyVerdict(key, value, REFUSED, f"the {arch!r} architecture is not built")
        suffix = key[len(arch) + 1 :]
        unread = KeyVerdict(key, value, REFUSED, "a hyperparameter tokenworks does not read")
        read = ARCH_READ | family.gguf_keys
        return _lookup(key, suffix, value, read, ARCH_INFO, ARCH_CHECKED) or unread
    if key.startswith("tokenizer."):
        return KeyVerdict(key, value, INFO, "not used by the tokenizer")
    return KeyVerdict(key, value, INFO, "describes the file")


def _needs_value(key: str, arch: str, family) -> bool:
    """Whether a key's verdict depends on its value (the rest are judged by name alone)."""
    if key in TOKENIZER_CHECKED:
        return True
    known = ARCH_READ | ARCH_INFO | family.gguf_keys
    return key.startswith(f"{arch}.") and key[len(arch) + 1 :] not in known


def first_refusal(get: Callable[[str], object], keys, arch: str, family) -> KeyVerdict | None:
    """The first key of a file `family` reads that asks for what is not built. Only the
    values a verdict depends on are read: a vocabulary's 250,000 strings are not."""
    for key in keys:
        value = get(key) if _needs_value(key, arch, family) else None
        verdict = judge(key, value, arch, family)
        if verdict.action == REFUSED:
            return verdict
    return None


def rope_scaling(field, arch: str, context_length: int) -> RopeScaling | None:
    """The scaling `{arch}.rope.scaling.*` asks for, read as llama.cpp reads it: a factor
    with no type is linear (as is the older `rope.scale_linear`); YaRN's cos and sin carry
    its usual 0.1 ln(factor) + 1 times the file's attn_factor. Another type is refused
    (judge refuses the keys with no counterpart here)."""
    key = f"{arch}.rope.scaling"
    kind = field(f"{key}.type")
    factor = field(f"{key}.factor") or field(f"{arch}.rope.scale_linear")
    if kind is None:
        kind = "linear" if factor not in (None, 0, 1) else "none"
    if kind == "none":
        return None
    if kind not in ("linear", "yarn"):
        raise ValueError(f"{key}.type = {kind!r} is not supported (none, linear and yarn are)")
    if not factor or float(factor) <= 0:
        raise ValueError(f"{key}.type = {kind!r} needs {key}.factor > 0, got {factor}")
    factor = float(factor)
    original = int(field(f"{key}.original_context_length") or context_length)
    if kind == "linear":
        return RopeScaling(factor=factor, original_max_position=original, kind="linear")
    attn = field(f"{key}.attn_factor")
    # DeepSeek's mscale_all_dim, as 0.1 x it (read where the family reads the key; its cos
    # and sin then stay unscaled, and its attention scale takes mscale squared)
    log_mul = float(field(f"{key}.yarn_log_multiplier") or 0.0)
    return RopeScaling(
        factor=factor,
        original_max_position=original,
        kind="yarn",
        beta_fast=float(field(f"{key}.yarn_beta_fast") or 32.0),
        beta_slow=float(field(f"{key}.yarn_beta_slow") or 1.0),
        attention_factor=None if attn is None else yarn_mscale(factor) * float(attn),
        mscale=log_mul / 0.1 if log_mul else None,
        mscale_all_dim=log_mul / 0.1 if log_mul else None,
    )

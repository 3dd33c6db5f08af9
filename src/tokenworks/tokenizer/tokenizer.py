"""Text <-> token ids with Hugging Face `tokenizers`, built from GGUF metadata or tokenizer.json.

GGUF files carry either a byte-level BPE vocabulary and merge list plus a pre-tokeniser
name (`tokenizer.ggml.pre`), or a SentencePiece vocabulary with scores
(tokenizer/sentencepiece.py). We rebuild the same `tokenizers.Tokenizer` that the model's
own tokenizer.json describes: the merges, the byte-level alphabet, and the splitting regex
that the pre-tokeniser name stands for in llama.cpp.
"""

from __future__ import annotations

from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers

from tokenworks.tokenizer.chat import ChatTemplate
from tokenworks.tokenizer.sentencepiece import sentencepiece_from_gguf

# llama.cpp pre-tokeniser names -> the splitting their models were trained with.
_DIGITS_THEN_BYTELEVEL = ("smollm", "starcoder", "refact", "codeshell", "command-r")
_LLAMA3_PATTERN = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*"
    r"|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_QWEN2_PATTERN = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*"
    r"|\s*[\r\n]+|\s+(?!\S)|\s+"
)
# o200k (gpt-oss, Phi-4): a word keeps its contraction, its case runs split, digits by 3
_O200K_PATTERN = (
    r"[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]*[\p{Ll}\p{Lm}\p{Lo}\p{M}]+"
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)?"
    r"|[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]+[\p{Ll}\p{Lm}\p{Lo}\p{M}]*"
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)?"
    r"|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n/]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
# llama.cpp's pre-tokeniser names -> the splitting regex (dbrx: OLMo 2's cl100k, smaug-bpe:
# SmolLM3's, both Llama 3's)
_PATTERNS = {
    "llama-bpe": _LLAMA3_PATTERN, "llama3": _LLAMA3_PATTERN, "dbrx": _LLAMA3_PATTERN,
    "smaug-bpe": _LLAMA3_PATTERN, "qwen2": _QWEN2_PATTERN, "gpt-4o": _O200K_PATTERN,
}  # fmt: skip

_CONTROL = 3  # gguf token_type for control (special) tokens
_USER_DEFINED = 4


class TokenizerError(ValueError):
    pass


def _pre_tokenizer(pre: str):
    bytelevel = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    if pre in ("default", "gpt2", "gpt-2", None):
        return bytelevel
    if pre in _DIGITS_THEN_BYTELEVEL:
        return pre_tokenizers.Sequence([pre_tokenizers.Digits(individual_digits=True), bytelevel])
    if pre in _PATTERNS:
        return pre_tokenizers.Sequence(
            [
                pre_tokenizers.Split(Regex(_PATTERNS[pre]), behavior="isolated", invert=False),
                pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
            ]
        )
    raise TokenizerError(
        f"GGUF pre-tokeniser {pre!r} is not supported yet; pass a Hugging Face directory with "
        "its tokenizer.json instead"
    )


def tokenizer_from_gguf_fields(fields: dict, arch: str | None = None) -> Tokenizer:
    kind = fields.get("tokenizer.ggml.model")
    if kind == "llama":
        return sentencepiece_from_gguf(fields, arch)
    if kind != "gpt2":
        raise TokenizerError(
            f"GGUF tokenizer model {kind!r} is not supported yet (byte-level BPE 'gpt2' and "
            "SentencePiece 'llama' are); pass a Hugging Face directory with its "
            "tokenizer.json instead"
        )
    tokens: list[str] = fields["tokenizer.ggml.tokens"]
    vocab = {t: i for i, t in enumerate(tokens)}
    merges = [tuple(m.split(" ", 1)) for m in fields["tokenizer.ggml.merges"]]
    tok = Tokenizer(models.BPE(vocab=vocab, merges=merges, fuse_unk=False, byte_fallback=False))
    tok.pre_tokenizer = _pre_tokenizer(fields.get("tokenizer.ggml.pre"))
    tok.decoder = decoders.ByteLevel()
    types = fields.get("tokenizer.ggml.token_type") or []
    from tokenizers import AddedToken

    special = [
        AddedToken(tokens[i], special=True, normalized=False)
        for i, t in enumerate(types)
        if t in (_CONTROL, _USER_DEFINED)
    ]
    tok.add_special_tokens(special)
    return tok


class TokenizerWrapper:
    """The one tokenizer interface the engine uses: encode, decode, chat templates."""

    def __init__(
        self,
        tokenizer: Tokenizer,
        *,
        bos_token_id: int | None = None,
        add_bos: bool = False,
        eos_token_ids: tuple[int, ...] = (),
        chat_template: str | None = None,
    ):
        self.tk = tokenizer
        self.bos_token_id = bos_token_id
        self.add_bos = add_bos
        self.eos_token_ids = eos_token_ids
        self.chat = ChatTemplate(chat_template, self) if chat_template else None

    @classmethod
    def from_loaded(cls, loaded) -> TokenizerWrapper:
        src = loaded.tokenizer_source
        if src.get("kind") == "gguf":
            f = src["fields"]
            tk = tokenizer_from_gguf_fields(f, loaded.spec.arch)
            add_bos = bool(f.get("tokenizer.ggml.add_bos_token", False))
        elif src.get("kind") == "object":
            tk, add_bos = src["tokenizer"], False
        elif src.get("kind") == "json":
            tk = Tokenizer.from_file(src["path"])
            add_bos = False  # tokenizer.json's post-processor adds BOS where the model wants it
        else:
            raise TokenizerError(
                f"{loaded.model_id} has no tokenizer (no tokenizer.json, no GGUF vocabulary)"
            )
        return cls(
            tk,
            bos_token_id=loaded.spec.bos_token_id,
            add_bos=add_bos,
            eos_token_ids=loaded.spec.eos_token_ids,
            chat_template=loaded.chat_template,
        )

    @property
    def vocab_size(self) -> int:
        return self.tk.get_vocab_size(with_added_tokens=True)

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        ids = self.tk.encode(text, add_special_tokens=add_special_tokens).ids
        if add_special_tokens and self.add_bos and self.bos_token_id is not None:
            if not ids or ids[0] != self.bos_token_id:
                ids = [self.bos_token_id, *ids]
        return ids

    def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str:
        return self.tk.decode(list(ids), skip_special_tokens=skip_special_tokens)

    def token_to_str(self, token_id: int) -> str:
        return self.tk.id_to_token(token_id) or ""

    def apply_chat_template(
        self, messages: list[dict], add_generation_prompt: bool = True, **kwargs
    ) -> str:
        if self.chat is None:
            raise TokenizerError(
                "this model has no chat template; use generate() with a plain prompt"
            )
        return self.chat.render(messages, add_generation_prompt=add_generation_prompt, **kwargs)

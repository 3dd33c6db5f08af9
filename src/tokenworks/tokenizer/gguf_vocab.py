"""A GGUF file's vocabulary as a `tokenizers.Tokenizer`: the kinds llama.cpp reads.

`tokenizer.ggml.model` names the algorithm:
- "gpt2": byte-level BPE, its merges in the file and its word splitting named by
  `tokenizer.ggml.pre` (tokenizer/splitting.py);
- "gemma4": BPE on the text's own UTF-8, "▁" for a space, byte pieces as fallback;
- "llama": SentencePiece (tokenizer/sentencepiece.py);
- "bert": WordPiece, the embedding models' (a word's first piece stored with "▁" in front,
  its continuations bare, where tokenizer.json writes "##" on the continuations).
The pieces a vocabulary marks control or user-defined are matched as tokenizer/added_tokens.py
says.
"""

from __future__ import annotations

from tokenizers import Tokenizer, decoders, models, normalizers, pre_tokenizers

from tokenworks.tokenizer.added_tokens import CONTROL, add_vocab_tokens
from tokenworks.tokenizer.errors import TokenizerError
from tokenworks.tokenizer.sentencepiece import SPACE, sentencepiece_from_gguf
from tokenworks.tokenizer.splitting import SPLITTINGS, Splitting


def _splitting(pre) -> Splitting:
    name = pre if pre else "default"  # a file with no pre-tokeniser: llama.cpp's default
    try:
        return SPLITTINGS[name]
    except KeyError:
        raise TokenizerError(
            f"GGUF pre-tokeniser {name!r} is not known to tokenworks; pass a Hugging Face "
            "directory with its tokenizer.json instead"
        ) from None


def bpe_from_gguf(fields: dict, splitting: Splitting) -> Tokenizer:
    tokens: list[str] = fields["tokenizer.ggml.tokens"]
    merges = [tuple(m.split(" ", 1)) for m in fields["tokenizer.ggml.merges"]]
    tok = Tokenizer(models.BPE(
        vocab={t: i for i, t in enumerate(tokens)}, merges=merges, fuse_unk=False,
        byte_fallback=not splitting.byte_level, ignore_merges=splitting.ignore_merges,
    ))  # fmt: skip
    tok.pre_tokenizer = splitting.pre_tokenizer()
    if splitting.byte_level:
        tok.decoder = decoders.ByteLevel()
    else:
        tok.normalizer = normalizers.Replace(" ", SPACE)
        tok.decoder = decoders.Sequence(
            [decoders.Replace(SPACE, " "), decoders.ByteFallback(), decoders.Fuse()]
        )
    add_vocab_tokens(tok, tokens, fields.get("tokenizer.ggml.token_type") or [])
    return tok


def wordpiece_from_gguf(fields: dict) -> Tokenizer:
    tokens: list[str] = fields["tokenizer.ggml.tokens"]
    types = fields.get("tokenizer.ggml.token_type") or [1] * len(tokens)
    # back to tokenizer.json's spelling: "▁word" starts a word, a bare piece continues one
    spelled = [
        t if types[i] == CONTROL else t[1:] if t.startswith(SPACE) else f"##{t}"
        for i, t in enumerate(tokens)
    ]
    unk = fields.get("tokenizer.ggml.unknown_token_id")
    tok = Tokenizer(models.WordPiece(
        {t: i for i, t in reversed(list(enumerate(spelled)))},
        unk_token=spelled[unk] if unk is not None else "[UNK]", max_input_chars_per_word=100,
    ))  # fmt: skip
    lowercase = bool(fields.get("tokenizer.ggml.normalizer.lowercase", True))
    tok.normalizer = normalizers.BertNormalizer(
        clean_text=True, handle_chinese_chars=True, lowercase=lowercase,
        strip_accents=bool(fields.get("tokenizer.ggml.normalizer.strip_accents", lowercase)),
    )  # fmt: skip
    tok.pre_tokenizer = pre_tokenizers.BertPreTokenizer()
    tok.decoder = decoders.WordPiece()
    add_vocab_tokens(tok, spelled, types)
    return tok


def tokenizer_from_gguf_fields(fields: dict, arch: str | None = None) -> Tokenizer:
    kind = fields.get("tokenizer.ggml.model")
    if kind == "llama":
        return sentencepiece_from_gguf(fields, arch)
    if kind == "gpt2":
        return bpe_from_gguf(fields, _splitting(fields.get("tokenizer.ggml.pre")))
    if kind == "gemma4":
        return bpe_from_gguf(fields, SPLITTINGS["gemma4"])
    if kind == "bert":
        return wordpiece_from_gguf(fields)
    raise TokenizerError(
        f"GGUF tokenizer model {kind!r} is not supported (byte-level BPE 'gpt2', Gemma 4's "
        "'gemma4', SentencePiece 'llama' and WordPiece 'bert' are); pass a Hugging Face "
        "directory with its tokenizer.json instead"
    )

"""How a byte-level BPE model splits text into words before merging: llama.cpp's
pre-tokeniser names (`tokenizer.ggml.pre`) -> the splitting each family was trained with.

A splitting is a list of regexes applied in turn: each cuts every piece the one before left
into its matches and the text between them, all kept (`tokenizers`' "isolated" split). The
patterns are those of each family's tokenizer.json, which is what llama.cpp's own tables
stand for; its tokenizer test vectors (tests/test_vocab_vectors.py) hold them to it.
"""

from __future__ import annotations

from dataclasses import dataclass

from tokenizers import Regex, pre_tokenizers

_CONTRACTIONS = r"(?i:'s|'t|'re|'ve|'m|'ll|'d)"
_GPT2 = r"'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)"
_TAIL = r"|\s*[\r\n]+|\s+(?!\S)|\s+"


def _cl100k(digits: str) -> str:
    return (
        rf"{_CONTRACTIONS}|[^\r\n\p{{L}}\p{{N}}]?\p{{L}}+|{digits}"
        rf"| ?[^\s\p{{L}}\p{{N}}]+[\r\n]*{_TAIL}"
    )


def _o200k(digits: str, marks: str = "", contraction: str = f"{_CONTRACTIONS}?",
           after_symbols: str = r"[\r\n/]*") -> str:
    """gpt-4o's words: a run of capitals then one of small letters, a contraction kept."""
    upper = rf"[\p{{Lu}}\p{{Lt}}\p{{Lm}}\p{{Lo}}\p{{M}}{marks}]"
    lower = rf"[\p{{Ll}}\p{{Lm}}\p{{Lo}}\p{{M}}{marks}]"
    return (
        rf"[^\r\n\p{{L}}\p{{N}}]?{upper}*{lower}+{contraction}"
        rf"|[^\r\n\p{{L}}\p{{N}}]?{upper}+{lower}*{contraction}"
        rf"|{digits}| ?[^\s\p{{L}}\p{{N}}]+{after_symbols}{_TAIL}"
    )


_LLAMA3 = _cl100k(r"\p{N}{1,3}")
_QWEN2 = _cl100k(r"\p{N}")
_QWEN35 = (
    rf"{_CONTRACTIONS}|[^\r\n\p{{L}}\p{{N}}]?[\p{{L}}\p{{M}}]+|\p{{N}}"
    rf"| ?[^\s\p{{L}}\p{{M}}\p{{N}}]+[\r\n]*{_TAIL}"
)
_GPT4O = _o200k(r"\p{N}{1,3}")
_TEKKEN = _o200k(r"\p{N}", contraction="")
_DEEPSEEK3 = (
    r"\p{N}{1,3}",
    r"[一-龥぀-ゟ゠-ヿ]+",
    r"[!\"#$%&'()*+,\-./:;<=>?@\[\\\]^_`{|}~][A-Za-z]+|[^\r\n\p{L}\p{P}\p{S}]?[\p{L}\p{M}]+"
    rf"| ?[\p{{P}}\p{{S}}]+[\r\n]*{_TAIL}",
)
_NOT_HAN = r"&&[^\p{Han}]"
_KIMI_K2 = r"[\p{Han}]+|" + _o200k(r"\p{N}{1,3}", _NOT_HAN, after_symbols=r"[\r\n]*")
# the cased scripts' letters (Latin, Greek, Cyrillic, Armenian, Georgian, Cherokee...) as
# deepseek-llm's tokenizer.json lists them, by code point
_DEEPSEEK_LETTERS = "".join(
    "-".join(chr(int(end, 16)) for end in span.split("-"))
    for span in (
        "0041-005A 0061-007A 00B5 00C0-00D6 00D8-00F6 00F8-01BA 01BC-01BF 01C4-0293 0295-02AF "
        "0370-0373 0376 0377 037B-037D 037F 0386 0388-038A 038C 038E-03A1 03A3-03F5 03F7-0481 "
        "048A-052F 0531-0556 10A0-10C5 13A0-13F5 13F8-13FD 1C90-1CBA 1CBD-1CBF 1D00-1D2B "
        "1D6B-1D77 1D79-1D9A 1E00-1F15 1F18-1F1D 1F20-1F45 1F48-1F4D 1F50-1F57 1F59 1F5B 1F5D "
        "1F5F-1F7D 1F80-1FB4 1FB6-1FBC 1FBE 1FC2-1FC4 1FC6-1FCC 1FD0-1FD3 1FD6-1FDB 1FE0-1FEC "
        "1FF2-1FF4 1FF6-1FFC 2102 2107 210A-2113 2115 2119-211D 2124 2126 2128 212A-212D "
        "212F-2134 2139 213C-213F 2145-2149 214E 2183 2184 2C00-2C7B 2C7E-2CE4 2CEB-2CEE 2CF2 "
        "2CF3 A640-A66D A680-A69B A722-A76F A771-A787 A78B-A78E AB70-ABBF FB00-FB06 FB13-FB17 "
        "FF21-FF3A FF41-FF5A 10400-1044F 104B0-104D3 104D8-104FB 10C80-10CB2 10CC0-10CF2 "
        "118A0-118DF 1E900-1E943"
    ).split()
)
_CJK_HANGUL = r"[一-龥ࠀ-一가-퟿]+"
_LINES = r"[^\n]+|[\n]+"


@dataclass(frozen=True)
class Splitting:
    patterns: tuple[str, ...]
    # a word that is itself a token is taken whole, not merged up to (Llama 3's tokenizer.json
    # says "ignore_merges")
    ignore_merges: bool = False
    # GPT-2's bytes-as-characters alphabet; False: the text's own UTF-8 with "▁" for a space
    # and <0xNN> pieces for bytes no piece covers (Gemma 4)
    byte_level: bool = True

    def pre_tokenizer(self):
        steps = [
            pre_tokenizers.Split(Regex(p), behavior="isolated", invert=False)
            for p in self.patterns
        ]
        if self.byte_level:
            steps.append(pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False))
        return pre_tokenizers.Sequence(steps)


def _one(pattern: str, **kw) -> Splitting:
    return Splitting((pattern,), **kw)


_DIGITS_THEN_GPT2 = Splitting((r"\p{N}", _GPT2))
_FAMILIES: dict[tuple[str, ...], Splitting] = {
    ("default",): Splitting(
        (r"[\p{P}\$\+<=>\^~\|]+", _GPT2, r"\p{N}+", r"[0-9][0-9][0-9]")
    ),
    ("llama3", "llama-v3", "llama-bpe", "falcon3", "falcon-h1", "pixtral", "midm-2.0", "lfm2",
     "jina-v5-nano"): _one(_LLAMA3, ignore_merges=True),
    ("dbrx", "smaug-bpe", "chatglm-bpe"): _one(_LLAMA3),
    ("glm4", "glm5"): _one(_LLAMA3, ignore_merges=True),
    ("minicpm5",): Splitting((r"\p{N}{1,3}", _cl100k(r"\p{N}+")), ignore_merges=True),
    ("deepseek-llm",): Splitting((
        r"[\r\n]", rf"\s?[{_DEEPSEEK_LETTERS}]+", r"\s?[!-/:-~！-／：-～‘-‟　-。]+", r"\s+$",
        _CJK_HANGUL, r"\p{N}+",
    )),
    ("deepseek-coder",): Splitting(
        (r"[\r\n]", r"\s?\p{L}+", r"\s?\p{P}+", _CJK_HANGUL, r"\p{N}")
    ),
    ("deepseek-v3", "hunyuan-dense", "joyai-llm", "hy_v4"): Splitting(_DEEPSEEK3),
    ("falcon",): Splitting((r"[\p{P}\$\+<=>\^~\|`]+", _GPT2, r"[0-9][0-9][0-9]")),
    ("starcoder", "refact", "command-r", "smollm", "codeshell", "exaone", "minerva-7b",
     "mellum2"): _DIGITS_THEN_GPT2,
    ("gpt-2", "gpt2", "phi-2", "jina-es", "jina-de", "gigachat", "jina-v2-es", "jina-v2-de",
     "a.x-4.0", "mellum", "modern-bert", "jina-v1-en", "jina-v2-code", "roberta-bpe", "mpt",
     "olmo", "jais", "trillion", "granite-docling", "exaone4"): _one(_GPT2),
    ("qwen2", "deepseek-r1-qwen", "kormo", "f2llmv2", "stablelm2", "hunyuan", "solar-open",
     "megrez", "grok-2"): _one(_QWEN2),
    ("qwen35",): _one(_QWEN35),
    ("seed-coder",): _one(
        rf"{_CONTRACTIONS}|[^\r\n\p{{L}}\p{{N}}]?\p{{L}}+|\p{{N}}| ?[^\s\p{{L}}\p{{N}}\r\n]+"
        + _TAIL
    ),
    ("poro-chat", "bloom", "gpt3-finnish"): _one(r" ?[^(\s|.,!?…。，、।۔،)]+"),
    ("viking",): Splitting((r" ?[^(\s|.,!?…。，、।۔،)]+", r"\p{N}")),
    ("tekken",): _one(_TEKKEN, ignore_merges=True),
    ("gpt-4o", "llama4", "kanana2", "talkie", "minimax-m2"): _one(_GPT4O),
    ("tiny_aya", "cohere2moe"): Splitting((r"\d{1,3}(?=(?:\d{3})*\b)", _GPT4O)),
    ("kimi-k2",): _one(_KIMI_K2),
    ("bailingmoe", "bailingmoe2", "llada-moe"): _one(
        r"'(?i:[sdmt]|ll|ve|re)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*"
        r"|\s*[\r\n]|\s+(?!\S)|\s+"
    ),
    ("ufakzeka",): _one(
        r"[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*" + _TAIL
    ),
    ("laguna",): Splitting((_LINES, _QWEN2)),
    ("exaone-moe",): _one(
        rf"{_CONTRACTIONS}|[^\r\n\p{{L}}\p{{N}}]?(?:\p{{L}}\p{{M}}*(?: \p{{L}}\p{{M}}*)*)+"
        r"|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n/]?|\s*[\r\n]|\s+(?!\S)|\s+"
    ),
    ("gemma4", "granite-embed-multi-311m"): _one(_LINES, byte_level=False),
}  # fmt: skip
SPLITTINGS = {name: s for names, s in _FAMILIES.items() for name in names}

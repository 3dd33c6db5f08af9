"""SentencePiece vocabularies from GGUF metadata (`tokenizer.ggml.model = llama`): Llama 2,
Mistral, Gemma.

A GGUF file carries the pieces, their scores and their types, and no merge list. A
SentencePiece BPE model merges the pair whose merged piece ranks best, so the merges are
recovered from the vocabulary: every way of cutting a piece into two pieces that are both
in the vocabulary is a merge, ranked by the piece it makes. Llama's pieces rank by score;
Gemma's scores do not follow its merge order, and its pieces rank by their place in the
file instead (as transformers' GGUF reader ranks them). Text is spelled with "▁" for a
space (Llama's files add one in front of text that does not start with a space; Gemma's
do not), and bytes that no piece covers fall back to `<0xNN>` pieces.
"""

from __future__ import annotations

from tokenizers import AddedToken, Tokenizer, decoders, models, normalizers, pre_tokenizers

SPACE = "\u2581"
_CONTROL, _USER_DEFINED = 3, 4  # gguf token types


def _ranked_merges(tokens: list[str], rank: list[float]) -> list[tuple[str, str]]:
    """Every (left, right) cut of a piece into two pieces of the vocabulary, best-ranked
    merged piece first; a piece's own cuts longest left half first, equal ranks in
    vocabulary order (the order transformers' reader gives, so the two tokenise alike)."""
    vocab = {t: i for i, t in enumerate(tokens)}
    found = []
    for index, piece in enumerate(tokens):
        for cut in range(1, len(piece)):
            left, right = piece[:cut], piece[cut:]
            if left in vocab and right in vocab:
                found.append((-rank[index], -cut, cut - len(piece), index, left, right))
    found.sort()
    return [(left, right) for *_, left, right in found]


def sentencepiece_from_gguf(fields: dict, arch: str | None = None) -> Tokenizer:
    tokens = list(fields["tokenizer.ggml.tokens"])
    types = list(fields.get("tokenizer.ggml.token_type") or [1] * len(tokens))
    gemma = (arch or "").startswith("gemma")
    if gemma:
        # a piece of two or more spaces is stored as spaces; it is looked up as "▁▁"
        tokens = [SPACE * len(t) if t and not t.strip(" ") else t for t in tokens]
        rank = [-i for i in range(len(tokens))]
    else:
        rank = list(fields["tokenizer.ggml.scores"])
    unk = fields.get("tokenizer.ggml.unknown_token_id")
    model = models.BPE(
        vocab={t: i for i, t in enumerate(tokens)},
        merges=_ranked_merges(tokens, rank),
        unk_token=tokens[unk] if unk is not None else None,
        fuse_unk=True,
        byte_fallback=True,
    )
    tok = Tokenizer(model)
    prefix = bool(fields.get("tokenizer.ggml.add_space_prefix", not gemma))
    if prefix:  # Llama 2, Mistral: spaces as "▁", and one in front unless the text has one
        tok.pre_tokenizer = pre_tokenizers.Metaspace(SPACE, prepend_scheme="first", split=False)
    else:
        tok.normalizer = normalizers.Replace(" ", SPACE)
    steps = [decoders.Replace(SPACE, " "), decoders.ByteFallback(), decoders.Fuse()]
    if prefix:
        steps.append(decoders.Strip(" ", 1, 0))
    tok.decoder = decoders.Sequence(steps)
    tok.add_special_tokens(
        [AddedToken(tokens[i], special=True, normalized=False) for i, t in enumerate(types)
         if t == _CONTROL]
    )  # fmt: skip
    tok.add_tokens(
        [AddedToken(tokens[i], special=False, normalized=False) for i, t in enumerate(types)
         if t == _USER_DEFINED]
    )  # fmt: skip
    return tok

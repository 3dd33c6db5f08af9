"""SentencePiece vocabularies from GGUF metadata (`tokenizer.ggml.model = llama`): Llama 2,
Mistral, Gemma.

A GGUF file carries the pieces, their scores and their types, and no merge list. A
SentencePiece BPE model merges the pair whose merged piece ranks best, so the merges are
recovered from the vocabulary: every way of cutting a piece into two pieces that are both
in the vocabulary is a merge, ranked by the piece it makes. Llama's pieces rank by score;
Gemma's scores do not follow its merge order, and its pieces rank by their place in the
file instead (as transformers' GGUF reader ranks them). Text is spelled with "▁" for a
space, and bytes that no piece covers fall back to `<0xNN>` pieces. Llama's files put one
"▁" in front of every stretch of text, one that starts with a space too (SentencePiece's
dummy prefix, as llama.cpp adds it: " Hello" is "▁▁Hello"), and after each special token;
Gemma's do not.
"""

from __future__ import annotations

from tokenizers import Tokenizer, decoders, models, normalizers

from tokenworks.tokenizer.added_tokens import CONTROL, add_vocab_tokens

SPACE = "\u2581"
# the pieces Phi-3's tokenizer.json lets eat the spaces after them: its control tokens and
# "</s>", but for these (llama.cpp sets the same)
_PHI3_KEEPS_SPACES = ("<unk>", "<s>", "<|endoftext|>")


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
    tok.normalizer = normalizers.Replace(" ", SPACE)
    if prefix:  # (a normalizer runs on each stretch between added tokens: each gets its "▁")
        tok.normalizer = normalizers.Sequence([normalizers.Prepend(SPACE), tok.normalizer])
    steps = [decoders.Replace(SPACE, " "), decoders.ByteFallback(), decoders.Fuse()]
    if prefix:
        steps.append(decoders.Strip(" ", 1, 0))
    tok.decoder = decoders.Sequence(steps)
    rstrip = ()
    if arch == "phi3":
        rstrip = {i for i, t in enumerate(tokens) if t not in _PHI3_KEEPS_SPACES
                  and (types[i] == CONTROL or t == "</s>")}  # fmt: skip
    add_vocab_tokens(tok, tokens, types, rstrip)
    return tok

"""How a vocabulary's own pieces are matched in text, by their GGUF token type: a control
token (type 3) only where the caller parses special tokens, a user-defined one (type 4)
always, before the model sees the text, as both llama.cpp and `tokenizers` do."""

from __future__ import annotations

from tokenizers import AddedToken, Tokenizer

CONTROL, USER_DEFINED = 3, 4


def add_vocab_tokens(tok: Tokenizer, tokens: list[str], types: list[int], rstrip=()) -> None:
    """Control pieces as special tokens, user-defined ones as plain added tokens; the ids in
    `rstrip` take the spaces after them (Phi-3's)."""

    def added(i: int, special: bool) -> AddedToken:
        return AddedToken(tokens[i], special=special, normalized=False, rstrip=i in rstrip)

    tok.add_special_tokens([added(i, True) for i, t in enumerate(types) if t == CONTROL])
    tok.add_tokens([added(i, False) for i, t in enumerate(types) if t == USER_DEFINED])

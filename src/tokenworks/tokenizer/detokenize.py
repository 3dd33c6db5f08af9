"""Incremental detokenisation: text pieces, one per new token, that never split a character.

Byte-level BPE tokens are byte strings; a multi-byte UTF-8 character can be spread over two
or three tokens, and decoding the first alone gives U+FFFD. We decode a small window of
recent tokens twice (with and without the new one) and emit the difference only once it no
longer ends in an incomplete character. The pieces concatenate to the full decode: that is
the property the tests check, on random token streams.
"""

from __future__ import annotations

_REPLACEMENT = "\ufffd"


class DecodeStream:
    def __init__(self, tokenizer, skip_special_tokens: bool = True, prompt_ids=()):
        self.tokenizer = tokenizer
        self.skip = skip_special_tokens
        self.ids: list[int] = list(prompt_ids)
        # ids[prefix:read] decodes to text already emitted; ids[read:] is pending.
        self.prefix = max(0, len(self.ids) - 5)
        self.read = len(self.ids)

    def _decode(self, ids: list[int]) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=self.skip)

    def step(self, token_id: int) -> str:
        """Add one token; return the text it completes ('' while a character is partial)."""
        self.ids.append(token_id)
        prefix_text = self._decode(self.ids[self.prefix : self.read])
        new_text = self._decode(self.ids[self.prefix :])
        if len(new_text) > len(prefix_text) and not new_text.endswith(_REPLACEMENT):
            self.prefix, self.read = self.read, len(self.ids)
            return new_text[len(prefix_text) :]
        return ""

    def flush(self) -> str:
        """Text still pending at the end of a stream (a dangling partial character)."""
        prefix_text = self._decode(self.ids[self.prefix : self.read])
        new_text = self._decode(self.ids[self.prefix :])
        self.prefix = self.read = len(self.ids)
        return new_text[len(prefix_text) :]

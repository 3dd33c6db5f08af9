"""A sequence's output side: its tokens as text, its stop rules, logprobs and stream text.

The engine side of a sequence (engine/sequence.py) holds its tokens and KV state; this
turns each new token into what the caller sees: incrementally detokenised text, a stop at
a stop token or stop string (trimmed as the request asks), logprobs with their token
text, and the part of the text safe to stream (a tail that could still become a stop
string is held back).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from tokenworks.engine.request import FinishReason, SamplingParams, TokenLogprob
from tokenworks.tokenizer import DecodeStream

if TYPE_CHECKING:  # (the sampler needs torch; the API process detokenises without it)
    from tokenworks.engine.sampler import SampleResult


def token_logprob(
    tokenizer,
    token: int,
    logprob: float | None,
    top: list[tuple[int, float]] | None,
    rank: int | None = None,
) -> TokenLogprob:
    """A token's logprob with its text and its top alternatives' (text "" without a
    tokenizer)."""

    def piece(t: int) -> str:
        return tokenizer.decode([t], False) if tokenizer is not None else ""

    top = [(i, piece(i), lp) for i, lp in top or []]
    return TokenLogprob(token, piece(token), logprob, top, rank)


class SequenceOutput:
    """tokenizer None: token ids only (stop tokens and logprobs without their text, no stop
    strings): an engine whose caller detokenises (engine/detokenizer.py)."""

    def __init__(
        self, params: SamplingParams, tokenizer, eos_token_ids: tuple[int, ...], prompt_ids
    ):
        self.params, self.tokenizer = params, tokenizer
        self._stop_ids = set(params.stop_token_ids)
        if not params.ignore_eos:
            self._stop_ids |= set(eos_token_ids)
        self._detok = (
            DecodeStream(tokenizer, params.skip_special_tokens, prompt_ids)
            if tokenizer is not None
            else None
        )
        self.text = ""
        self._streamed = 0  # characters of self.text already handed to a stream
        self._scanned = 0  # stop strings cannot start before this offset of self.text
        self.logprobs: list[TokenLogprob] | None = [] if params.logprobs is not None else None

    def add(self, result: SampleResult) -> tuple[FinishReason, str | int] | None:
        """One new token: its text and logprobs; (reason, stop) where it stops the sequence."""
        return self.add_token(result.token_id, result.logprob, result.top)

    def add_token(
        self, token: int, logprob: float | None, top: list[tuple[int, float]] | None
    ) -> tuple[FinishReason, str | int] | None:
        if self.logprobs is not None:
            self.logprobs.append(token_logprob(self.tokenizer, token, logprob, top))
        if token in self._stop_ids:
            self.text += self._detok.flush() if self._detok is not None else ""
            return FinishReason.STOP, token
        if self._detok is None:
            return None
        self.text += self._detok.step(token)
        return self._stop_string()

    def end(self) -> tuple[FinishReason, str] | None:
        """The sequence ends for another reason (length, grammar): the rest of the text,
        and a stop string it may complete."""
        if self._detok is None:
            return None
        self.text += self._detok.flush()
        return self._stop_string()

    def _stop_string(self) -> tuple[FinishReason, str] | None:
        if not self.params.stop:
            return None
        hits = [(self.text.find(s, self._scanned), s) for s in self.params.stop]
        hits = [(i, s) for i, s in hits if i >= 0]
        if not hits:
            # A match found later must end in text not yet seen, so it starts after this.
            longest = max(len(s) for s in self.params.stop)
            self._scanned = max(0, len(self.text) - longest + 1)
            return None
        i, s = min(hits)
        keep = i + len(s) if self.params.include_stop_str_in_output else i
        self.text = self.text[:keep]
        return FinishReason.STOP, s

    def take_stream_text(self, finished: bool) -> str:
        """Text not yet streamed, holding back a tail that could still become a stop string."""
        end = len(self.text)
        if not finished and self.params.stop:
            for s in self.params.stop:
                for k in range(min(len(s) - 1, end), 0, -1):
                    if self.text.endswith(s[:k]):
                        end = min(end, len(self.text) - k)
                        break
        end = max(end, self._streamed)
        piece = self.text[self._streamed : end]
        self._streamed = end
        return piece

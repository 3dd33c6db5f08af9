"""Admission: can this request ever be served? Decided before any work is done, in one place
the engine and the server both ask.

A request is refused, with the reason and the limit it hits, when:
- its prompt is empty or holds a token id outside the vocabulary;
- its prompt leaves no room for one new token in the context (the model's own context,
  the context its RoPE scaling is made for, or a smaller --max-model-len);
- its prompt plus max_tokens exceeds the context;
- even with nothing else running, the KV pool could not hold it: prompt + max_tokens for
  the first sequence, and for each further parallel sample (n > 1) its own new tokens plus
  the block it shares with the prompt's copy-on-write tail; in every layer group
  (engine/kv_groups.py), where a windowed group holds only its window and the chunk being
  written.

What a request may wait for (a free slot, a full queue) is the scheduler's business; this
says only whether it could ever run.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from functools import cached_property

from tokenworks.engine.kv_groups import KVLayout


class PromptTooLongError(ValueError):
    """The prompt (or prompt + max_tokens) does not fit the context."""


class RequestTooLargeError(ValueError):
    """The request cannot fit in the KV pool even with nothing else running."""


@dataclass(frozen=True)
class Refusal:
    reason: str  # what is wrong and what to change
    limit: str  # "vocabulary", "context", "max_tokens" or "kv_memory"
    field: str  # the request field to change: prompt, max_tokens or n

    def error(self) -> ValueError:
        kinds = {"kv_memory": RequestTooLargeError, "vocabulary": ValueError}
        return kinds.get(self.limit, PromptTooLongError)(self.reason)


@dataclass(frozen=True)
class Admission:
    vocab_size: int
    context: int  # the engine's max_model_len
    context_source: str  # where that limit comes from, said in refusals
    num_blocks: int
    block_size: int
    layout: KVLayout = field(default_factory=lambda: KVLayout.single(1))
    chunk: int | None = 1  # tokens a prompt pass takes at least; None: the whole prompt

    def blocks_for(self, tokens: int) -> int:
        return -(-tokens // self.block_size)

    def _held(self, tokens: int, prompt_len: int) -> int:
        chunk = self.chunk or 1
        first = 0 if self.chunk else prompt_len
        return self.layout.blocks_held(tokens, self.block_size, chunk, first)

    def blocks_needed(self, prompt_len: int, max_tokens: int, n: int = 1) -> int:
        """The most KV blocks the request can hold at once with nothing else running."""
        total = min(prompt_len + max_tokens, self.context)
        sibling = self.layout.blocks_held(max_tokens + self.block_size, self.block_size)
        need = self._held(total, prompt_len) + (n - 1) * sibling
        return min(need, n * self._held(self.context, prompt_len))

    def room(self, prompt_len: int) -> int:
        """New tokens the context leaves after this prompt."""
        return self.context - prompt_len

    @cached_property
    def pool_tokens(self) -> int:
        """The longest sequence (up to the context) the whole pool holds, fed a token at
        a time."""
        lo, hi = 0, self.context
        while lo < hi:
            mid = (lo + hi + 1) // 2
            if self.layout.blocks_held(mid, self.block_size) <= self.num_blocks:
                lo = mid
            else:
                hi = mid - 1
        return lo

    def default_max_tokens(self, prompt_len: int) -> int:
        """What a request that names no max_tokens may generate: the rest of the context,
        or of the whole KV pool where that is smaller."""
        return max(1, min(self.room(prompt_len), self.pool_tokens - prompt_len))

    def check(
        self,
        prompt_ids: list[int],
        max_tokens: int | None = None,
        n: int = 1,
        max_tokens_field: str = "max_tokens",
        clamp: bool = False,
    ) -> Refusal | None:
        """None where the request can be served, else why not. clamp: max_tokens beyond
        the context is cut to it (the offline engine's way: the output ends with reason
        length) rather than refused (the server's: a 400 naming the field)."""
        bad = [t for t in prompt_ids if not 0 <= t < self.vocab_size]
        if bad:
            return Refusal(
                f"prompt token ids {bad[:5]} are outside the vocabulary [0, {self.vocab_size})",
                "vocabulary", "prompt",
            )  # fmt: skip
        return self.check_lengths(len(prompt_ids), max_tokens, n, max_tokens_field, clamp)

    def check_lengths(
        self,
        p: int,
        max_tokens: int | None = None,
        n: int = 1,
        max_tokens_field: str = "max_tokens",
        clamp: bool = False,
    ) -> Refusal | None:
        """check() for a prompt of p tokens whose ids are known to be good."""
        if p < 1:
            return Refusal("the prompt is empty: give at least one token", "context", "prompt")
        if self.room(p) < 1:
            return Refusal(
                f"the prompt has {p} tokens, but the context holds {self.context} "
                f"({self.context_source}; prompt plus at least one new token); shorten the "
                "prompt",
                "context", "prompt",
            )  # fmt: skip
        if max_tokens is not None and max_tokens > self.room(p) and clamp:
            max_tokens = self.room(p)
        if max_tokens is not None and max_tokens > self.room(p):
            return Refusal(
                f"{max_tokens_field} is {max_tokens}, but the context holds {self.context} "
                f"tokens ({self.context_source}) and the prompt takes {p}: at most "
                f"{self.room(p)} new tokens fit; lower {max_tokens_field} or shorten the prompt",
                "max_tokens", max_tokens_field,
            )  # fmt: skip
        new = max_tokens if max_tokens is not None else self.default_max_tokens(p)
        need = self.blocks_needed(p, new, n)
        if need > self.num_blocks:
            return Refusal(
                f"the request needs up to {need} KV blocks of {self.block_size} tokens "
                f"({min(p + new, self.context)} tokens x n={n}) but the whole pool has "
                f"{self.num_blocks}; lower max_tokens or n, shorten the prompt, or give the "
                "engine more KV memory (kv_cache_memory)",
                "kv_memory", "n" if n > 1 else max_tokens_field,
            )  # fmt: skip
        return None

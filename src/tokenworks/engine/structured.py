"""Structured output: a grammar (JSON schema, regex, choice list, Lark) turned into a token
mask each step with llguidance, so the sampler can only pick tokens that keep the output
inside the language. Greedy or sampled, the result parses.

`GrammarCompiler` wraps the model's tokenizer for llguidance once (~0.3 s); `compile()`
checks a request's grammar up front (a bad schema or regex is the caller's error, raised
before the request is queued) and returns a `TokenMatcher`, one per sequence, that follows
the tokens the sequence emits.
"""

from __future__ import annotations

from functools import lru_cache

import torch

from tokenworks.engine.grammars import grammar_source, load_llguidance
from tokenworks.engine.request import StructuredOutput, StructuredOutputError

# For each byte value, the bias of its 8 tokens: 0 where the bit is set, -inf where not.
_BYTE_BIAS = torch.where(
    ((torch.arange(256).unsqueeze(1) >> torch.arange(8)) & 1).bool(), 0.0, float("-inf")
)


class TokenMatcher:
    """One sequence's position in its grammar (GrammarCompiler.mask_rows reads its mask)."""

    def __init__(self, matcher):
        self._m = matcher

    def accept(self, token_id: int) -> None:
        self._m.consume_token(token_id)

    @property
    def stopped(self) -> bool:
        """The grammar is complete (or broken): nothing more may be generated."""
        return self._m.is_stopped() or self._m.is_error()

    def valid_prefix(self, tokens: list[int]) -> int:
        """How many of tokens, in order, the grammar allows from here (state unchanged)."""
        return self._m.validate_tokens(tokens)

    def fork(self) -> TokenMatcher:
        return TokenMatcher(self._m.deep_copy())


class GrammarCompiler:
    def __init__(self, tokenizer, vocab_size: int, eos_token_ids: tuple[int, ...]):
        llg = load_llguidance()
        self.vocab_size = vocab_size
        self._ll = llg.LLTokenizer(
            tokenizer.tk.to_str(), n_vocab=vocab_size, eos_token=list(eos_token_ids) or None
        )
        self._grammar = lru_cache(maxsize=256)(self._compile_source)

    def _compile_source(self, key: StructuredOutput) -> str:
        source = grammar_source(key)
        error = load_llguidance().LLMatcher.validate_grammar(source, self._ll)
        if error and not error.startswith("WARNING"):
            raise StructuredOutputError(f"the {key.kind} grammar is invalid: {error}")
        return source

    def mask_rows(self, logits: torch.Tensor, rows: list[tuple[int, TokenMatcher]]) -> None:
        """Set to -inf, in place, the logits each matcher forbids (rows: (row of logits,
        matcher)). The masks are filled one after another in this thread: llguidance's
        parallel executor was no faster here and its thread pool competes with torch's."""
        if not rows:
            return
        words = (self.vocab_size + 31) // 32
        bitmask = torch.empty((len(rows), words), dtype=torch.int32)
        for k, (_, m) in enumerate(rows):  # each call drops the GIL
            m._m.unsafe_compute_mask_ptr(bitmask[k].data_ptr(), words * 4)
        # Bit k of byte b allows token 8b + k: each mask byte picks its row of 8 biases
        # (0 or -inf) in one index_select, and one index_add_ puts them on the logits.
        bias = _BYTE_BIAS.index_select(0, bitmask.view(torch.uint8).flatten().int())
        bias = bias.view(len(rows), -1)[:, : logits.shape[-1]]
        index = torch.tensor([r for r, _ in rows])
        with torch.inference_mode():  # the logits come out of the model in inference mode
            logits.index_add_(0, index, bias.to(logits.dtype))

    def compile(self, so: StructuredOutput) -> TokenMatcher:
        matcher = load_llguidance().LLMatcher(self._ll, self._grammar(so), log_level=0)
        if matcher.is_error():
            raise StructuredOutputError(f"the {so.kind} grammar is invalid: {matcher.get_error()}")
        return TokenMatcher(matcher)

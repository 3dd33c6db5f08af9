"""Text for the updates of an engine core, which sends token ids alone (engine/core.py).

The core checks stop tokens, lengths and grammars, which need no text; here, in the API
process, each completion's tokens become text through the same SequenceOutput an
offline engine runs (incremental detokenisation, stop strings trimmed as the request
asks, a possible stop string held back from the stream, logprobs with their token text).
A stop string ends its completion here at once: the update says so, the tokens sampled
past it are dropped, and `stops` tells the caller which completions the core must stop
(vLLM's output processor works the same way).
"""

from __future__ import annotations

import time
from dataclasses import dataclass

from tokenworks.engine.messages import CompletionDelta, RequestUpdate
from tokenworks.engine.output import SequenceOutput, token_logprob
from tokenworks.engine.request import FinishReason, SamplingParams, TokenLogprob


@dataclass
class StopAt:
    """A completion a stop string ended after its first `keep` tokens."""

    index: int
    stop: str
    keep: int


class RequestText:
    """One request's completions as text, fed the core's token-only updates in order."""

    def __init__(self, params: SamplingParams, tokenizer, prompt_ids: list[int]):
        self.params, self.tokenizer, self.prompt_ids = params, tokenizer, prompt_ids
        self.outputs: dict[int, SequenceOutput] = {}
        self.kept: dict[int, int] = {}  # tokens of each completion handed out
        self.reasons: dict[int, str] = {}  # how each finished completion ended (here or core)
        self.stopped = False  # a stop string ended a completion here
        self.seconds = 0.0  # spent in apply()

    def apply(self, update: RequestUpdate) -> tuple[RequestUpdate | None, list[StopAt]]:
        """The update with its text (None where nothing in it is news), and the
        completions a stop string ended in it."""
        t0 = time.perf_counter()
        try:
            return self._apply(update)
        finally:
            self.seconds += time.perf_counter() - t0

    def _apply(self, update: RequestUpdate) -> tuple[RequestUpdate | None, list[StopAt]]:
        deltas, stops = [], []
        for d in update.deltas:
            if d.index in self.reasons:  # a stop string ended it: the core ran on a little
                continue
            delta, stop = self._delta(d)
            deltas.append(delta)
            if stop is not None:
                stops.append(stop)
        finished = update.finished or len(self.reasons) >= self.params.n
        if not deltas and not finished:
            return None, stops
        return (
            RequestUpdate(
                request_id=update.request_id,
                deltas=deltas,
                finished=finished,
                prompt_tokens=update.prompt_tokens,
                cached_tokens=update.cached_tokens,
                prompt_logprobs=self._prompt_logprobs(update.prompt_logprobs),
                embedding=update.embedding,
                kv_blocks=update.kv_blocks,
            ),
            stops,
        )

    def _prompt_logprobs(self, lps: list[TokenLogprob | None] | None):
        """The prompt logprobs with their tokens' text (the core sends ids alone)."""
        if lps is None:
            return None
        return [
            None
            if lp is None
            else token_logprob(
                self.tokenizer, lp.token_id, lp.logprob, [(i, v) for i, _, v in lp.top], lp.rank
            )
            for lp in lps
        ]

    def outcome(self) -> tuple[list[str], int]:
        """Each completion's finish reason, in index order, and the tokens handed out: what
        the request's timings should say where a stop string ended it here (the core may
        have sampled on before it heard)."""
        return [str(self.reasons[i]) for i in sorted(self.reasons)], sum(self.kept.values())

    def _delta(self, d: CompletionDelta) -> tuple[CompletionDelta, StopAt | None]:
        out = self.outputs.get(d.index)
        if out is None:
            eos = self.tokenizer.eos_token_ids
            out = self.outputs[d.index] = SequenceOutput(
                self.params, self.tokenizer, eos, self.prompt_ids
            )
        had = len(out.logprobs) if out.logprobs is not None else 0
        token_ids, reason, stop_reason, stop = d.token_ids, d.finish_reason, d.stop_reason, None
        for j, token in enumerate(d.token_ids):
            lp = d.logprobs[j] if d.logprobs is not None else None
            top = [(i, p) for i, _, p in lp.top] if lp is not None else None
            hit = out.add_token(token, lp.logprob if lp is not None else None, top)
            if hit is not None and isinstance(hit[1], str):  # a stop string
                token_ids, (reason, stop_reason) = d.token_ids[: j + 1], hit
                if d.finish_reason is None or j + 1 < len(d.token_ids):
                    stop = StopAt(d.index, hit[1], self.kept.get(d.index, 0) + j + 1)
                break
        else:
            if reason in (FinishReason.LENGTH, FinishReason.STOP) and stop_reason is None:
                hit = out.end()  # the rest of the text, and a stop string it completes
                if hit is not None:
                    reason, stop_reason = hit
        self.kept[d.index] = self.kept.get(d.index, 0) + len(token_ids)
        if reason is not None:
            self.reasons[d.index] = reason
            self.stopped |= isinstance(stop_reason, str)
        logprobs = out.logprobs[had:] if out.logprobs is not None else None
        text = out.take_stream_text(reason is not None)
        delta = CompletionDelta(
            index=d.index, text=text, token_ids=token_ids, logprobs=logprobs, finish_reason=reason,
            stop_reason=stop_reason, reasoning_tokens=d.reasoning_tokens,
        )
        return delta, stop

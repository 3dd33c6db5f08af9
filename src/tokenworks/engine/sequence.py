"""A request in flight: its tokens, its KV state, its place in the queue and its random
stream; what its tokens become for the caller lives in engine/output.py."""

from __future__ import annotations

import enum
import random
import time

import torch

from tokenworks.engine.output import SequenceOutput, token_logprob
from tokenworks.engine.request import (
    CompletionOutput,
    FinishReason,
    RequestOutput,
    SamplingParams,
    TokenLogprob,
)
from tokenworks.engine.sampler import SampleResult, prompt_logprobs
from tokenworks.engine.thinking import ThinkingState


class SequenceStatus(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED = "finished"


class Sequence:
    """One completion. A request with n > 1 is a group of sequences forked after its prompt.

    KV state: `block_tables` (per layer group, the KV blocks holding its tokens), `n_cached`
    (how many of its tokens have K/V written), `block_hashes`/`n_registered` (prefix-cache
    bookkeeping); engine/kv_cache.BlockManager alone writes them.
    Scheduling: `priority` (lower runs first under the priority policy) and `arrival`
    (a counter: earlier arrivals first, and a preempted sequence keeps its place).
    """

    lora: str | None = None  # the LoRA adapter it runs with (engine/lora.py)

    def __init__(
        self,
        request_id: str,
        prompt: str | None,
        prompt_ids: list[int],
        params: SamplingParams,
        tokenizer,
        eos_token_ids: tuple[int, ...],
        max_len: int,
        arrival: int = 0,
        priority: int = 0,
        cache_salt: str | None = None,
        index: int = 0,
        seed: int | None = None,
        matcher=None,
    ):
        self.request_id = request_id
        self.matcher = matcher  # structured output: a TokenMatcher (engine/structured.py)
        # Timestamps (time.monotonic) for serving metrics: queue time, TTFT, latency.
        self.arrival_time = time.monotonic()
        self.scheduled_time: float | None = None  # first admitted to the running set
        self.index = index
        self.arrival, self.priority, self.cache_salt = arrival, priority, cache_salt
        self.group: list[Sequence] = [self]  # the request's completions, in index order
        self.block_tables: list[list[int]] = []
        self.block_hashes: list[bytes] = []
        self.n_registered = 0
        self.tokens_hashes: list[bytes] = []  # block hashes without the salt (kv_cache.py)
        self.num_cached_prompt_tokens = 0  # prefix-cache hit on first admission
        self.prefix_miss: str | None = None  # and why it missed (prefix_cache.MISS_REASONS)
        self.num_preemptions = 0
        self._eos_token_ids = eos_token_ids
        self.prompt = prompt
        self.prompt_ids = list(prompt_ids)
        self.output_ids: list[int] = []
        self.params = params
        self.tokenizer = tokenizer
        self.status = SequenceStatus.WAITING
        self.finish_reason: FinishReason | None = None
        self.stop_reason: str | int | None = None
        self.n_cached = 0  # tokens whose K/V are in the cache
        self.max_len = max_len  # prompt + output may not exceed this (the context)
        if seed is None:
            seed = params.seed if params.seed is not None else random.getrandbits(63)
        self.generator = torch.Generator().manual_seed(seed)
        self._prompt_tensor = torch.tensor(self.prompt_ids, dtype=torch.long)
        self.output = SequenceOutput(params, tokenizer, eos_token_ids, prompt_ids)
        # each prompt token's logprob so far, where asked (the first token has none)
        self.prompt_logprobs: list[TokenLogprob | None] | None = (
            [None] if params.prompt_logprobs is not None else None
        )
        # pooling: the sum of the final hidden states of the positions read so far (float64)
        self._pooled: torch.Tensor | None = None
        self._pooled_upto = 0  # positions summed
        self.thinking = ThinkingState(params.thinking) if params.thinking is not None else None

    def spawn(self, index: int) -> Sequence:
        """A sibling for parallel sampling, made right after the prompt: same prompt, own
        random stream (seed + index when the request has a seed), no output yet."""
        seed = (self.params.seed + index) % 2**64 if self.params.seed is not None else None
        child = Sequence(
            self.request_id,
            self.prompt,
            self.prompt_ids,
            self.params,
            self.tokenizer,
            self._eos_token_ids,
            self.max_len,
            self.arrival,
            self.priority,
            self.cache_salt,
            index,
            seed,
            self.matcher.fork() if self.matcher is not None else None,
        )
        child.arrival_time, child.scheduled_time = self.arrival_time, self.scheduled_time
        child.status = self.status
        child.prompt_logprobs = self.prompt_logprobs
        child.group = self.group
        child.lora = self.lora
        self.group.append(child)
        return child

    @property
    def group_finished(self) -> bool:
        done = all(s.finished for s in self.group)
        # siblings are spawned when the first token is sampled; an abort can come before
        early = self.group[0].finish_reason in ("abort", "error")
        return done and (len(self.group) == self.params.n or early)

    @property
    def all_ids(self) -> list[int]:
        return self.prompt_ids + self.output_ids

    def ids_between(self, start: int, end: int) -> list[int]:
        """all_ids[start:end] without copying the whole sequence (a decode step wants one
        token of a few hundred)."""
        n = len(self.prompt_ids)
        if start >= n:
            return self.output_ids[start - n : end - n]
        if end <= n:
            return self.prompt_ids[start:end]
        return self.prompt_ids[start:] + self.output_ids[: end - n]

    def prompt_rows(self, n: int) -> range:
        """The positions among the next n fed whose logits give a prompt token's logprob
        not yet recorded (a row predicts the token after its position)."""
        if self.prompt_logprobs is None:
            return range(0)
        start = max(self.n_cached, len(self.prompt_logprobs) - 1)
        return range(start, min(self.n_cached + n, len(self.prompt_ids) - 1))

    def record_prompt_logprobs(self, first: int, logits: torch.Tensor) -> None:
        """The logprobs of prompt tokens first, first + 1, ... from the logits of the rows
        before each (prompt_rows)."""
        assert first == len(self.prompt_logprobs), "prompt logprobs recorded out of order"
        targets = self.prompt_ids[first : first + logits.shape[0]]
        found = prompt_logprobs(logits, targets, self.params.prompt_logprobs)
        for token, (lp, top, rank) in zip(targets, found, strict=True):
            self.prompt_logprobs.append(token_logprob(self.tokenizer, token, lp, top, rank))

    def pooled_rows(self, n: int) -> range:
        """The positions among the next n fed whose final hidden states an embedding pools
        and has not yet: every prompt position for mean pooling, the last for last."""
        pooling, last = self.params.pooling, len(self.prompt_ids) - 1
        if pooling is None:
            return range(0)
        start = max(self.n_cached, self._pooled_upto if pooling == "mean" else last)
        return range(start, min(self.n_cached + n, last + 1))

    def pool(self, first: int, hidden: torch.Tensor) -> None:
        """Add the final hidden states of positions first, first + 1, ... (pooled_rows)."""
        assert first == self._pooled_upto or self.params.pooling == "last", "pooled out of order"
        h = hidden.double().sum(0)
        self._pooled = h if self._pooled is None else self._pooled + h
        self._pooled_upto = first + hidden.shape[0]

    @property
    def embedding(self) -> list[float] | None:
        """The pooled prompt, unit length, once every position it needs is in."""
        if self._pooled is None or self._pooled_upto < len(self.prompt_ids):
            return None
        return torch.nn.functional.normalize(self._pooled, dim=0).float().tolist()

    @property
    def reusable_tokens(self) -> int:
        """How many leading tokens may come from the prefix cache: all but the last (it must
        run to give logits), and only those whose successors' prompt logprobs are recorded
        and whose hidden states a mean pooling has summed."""
        n = self.num_tokens - 1
        if self.prompt_logprobs is not None and len(self.prompt_logprobs) < len(self.prompt_ids):
            n = min(n, len(self.prompt_logprobs) - 1)
        if self.params.pooling == "mean" and self._pooled_upto < len(self.prompt_ids):
            n = min(n, self._pooled_upto)
        return n

    @property
    def num_tokens(self) -> int:
        return len(self.prompt_ids) + len(self.output_ids)

    @property
    def finished(self) -> bool:
        return self.status is SequenceStatus.FINISHED

    def output_tensor(self) -> torch.Tensor:
        return torch.tensor(self.output_ids, dtype=torch.long)

    def prompt_tensor(self) -> torch.Tensor:
        return self._prompt_tensor

    def finish(self, reason: FinishReason, stop_reason: str | int | None = None) -> None:
        self.status = SequenceStatus.FINISHED
        self.finish_reason = reason
        self.stop_reason = stop_reason

    @property
    def text(self) -> str:
        return self.output.text

    @property
    def logprobs(self) -> list[TokenLogprob] | None:
        return self.output.logprobs

    def append(self, result: SampleResult) -> None:
        """Record one sampled token and decide whether the sequence stops."""
        token = result.token_id
        self.output_ids.append(token)
        if self.thinking is not None:
            self.thinking.observe(self.output_ids)
        if self.matcher is not None:
            self.matcher.accept(token)
        stop = self.output.add(result)
        if stop is not None:
            self.finish(*stop)
            return
        grammar_done = self.matcher is not None and self.matcher.stopped
        if (
            grammar_done
            or len(self.output_ids) >= self.params.max_tokens
            or self.num_tokens >= self.max_len
        ):
            stop = self.output.end()
            if stop is not None:
                self.finish(*stop)
            else:
                self.finish(FinishReason.STOP if grammar_done else FinishReason.LENGTH)

    @property
    def forced_token(self) -> int | None:
        """The token this sequence must take next (a thinking budget's end marker)."""
        return self.thinking.forced if self.thinking is not None else None

    @property
    def free_tokens(self) -> int | None:
        """Tokens it may generate before one is forced (None: no bound)."""
        return self.thinking.free_tokens if self.thinking is not None else None

    @property
    def reasoning_tokens(self) -> int:
        if self.thinking is None:
            return 0
        return self.thinking.reasoning_tokens(len(self.output_ids))

    def take_stream_text(self) -> str:
        """Text not yet streamed (engine/output.py holds back a possible stop string)."""
        return self.output.take_stream_text(self.finished)

    def completion(self) -> CompletionOutput:
        return CompletionOutput(
            index=self.index,
            text=self.text,
            token_ids=list(self.output_ids),
            finish_reason=self.finish_reason,
            stop_reason=self.stop_reason,
            logprobs=self.logprobs,
            reasoning_tokens=self.reasoning_tokens,
        )

    def to_output(self) -> RequestOutput:
        """The whole request: every completion of the group, in index order."""
        head = self.group[0]
        return RequestOutput(
            request_id=self.request_id,
            prompt=self.prompt,
            prompt_token_ids=self.prompt_ids,
            outputs=[s.completion() for s in self.group],
            finished=self.group_finished,
            num_cached_tokens=head.num_cached_prompt_tokens,
            prefix_miss=head.prefix_miss,
            prompt_logprobs=head.prompt_logprobs,
            embedding=head.embedding,
        )

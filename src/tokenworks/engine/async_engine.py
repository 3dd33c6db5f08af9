"""AsyncEngine: the asyncio front of LLMEngine that the server submits to and streams from.

The engine runs in a thread of its own: a forward pass blocks for milliseconds to seconds,
and the event loop must keep accepting connections meanwhile. Coroutines never touch the
engine; they post commands that the engine thread applies between steps:

- `generate()` queues a request and yields a `RequestUpdate` for every step that gave it
  tokens (text, token ids, logprobs and finish reasons of each of its n completions);
- `abort()` cancels one. Commands are applied before the next step, so a cancelled request
  (a client that went away, a deadline that passed) stops within one step and its KV blocks
  go back to the pool at once.

If a forward pass raises, LLMEngine aborts the requests it touched; their streams get a
`RequestFailedError` and everyone else carries on. If sampling raises for one request
(LLMEngine.failures), that request alone fails, and the step's others go on.

An optional observer (duck-typed; serve/metrics.py has one) hears about every step and
every finished request, in the engine thread.
"""

from __future__ import annotations

import abc
import asyncio
import logging
import threading
import time
from collections import deque
from dataclasses import dataclass, field
from typing import Any

from tokenworks.engine.engine import LLMEngine
from tokenworks.engine.request import SamplingParams, TokenLogprob
from tokenworks.engine.sequence import Sequence
from tokenworks.engine.speculative.speculator import SpeculativeMetrics

log = logging.getLogger("tokenworks.engine")


class RequestFailedError(RuntimeError):
    """The engine failed while running this request (the engine itself carries on)."""


class EngineNotRunningError(RuntimeError):
    """The engine is not running (not started, shut down, or its core process died)."""


class RequestCancelledError(RuntimeError):
    """abort() ended the request (its stream ends with this, if anyone still reads it)."""


class DeadlineExceededError(TimeoutError):
    """The request did not finish before its deadline; it was cancelled."""


class ReaderTooSlowError(RuntimeError):
    """The stream's reader fell too far behind (max_backlog tokens undelivered, or none
    taken for max_stall_s while some waited): the request was cancelled and its blocks
    freed, so one slow client never grows the server's memory without end."""


@dataclass
class CompletionDelta:
    """What one step added to one completion of a request."""

    index: int
    text: str
    token_ids: list[int]
    logprobs: list[TokenLogprob] | None
    finish_reason: str | None
    stop_reason: str | int | None


@dataclass
class RequestUpdate:
    request_id: str
    deltas: list[CompletionDelta]
    finished: bool
    prompt_tokens: int
    cached_tokens: int


@dataclass
class RequestMetrics:
    """Timings of one finished request, in seconds, for the serving metrics."""

    request_id: str
    finish_reasons: list[str]
    prompt_tokens: int
    generation_tokens: int
    queue_time: float | None  # arrival -> first scheduled
    ttft: float | None  # arrival -> first token out
    e2e: float  # arrival -> finished

    @property
    def tpot(self) -> float | None:
        """Mean time per output token after the first."""
        if self.ttft is None or self.generation_tokens < 2:
            return None
        return (self.e2e - self.ttft) / (self.generation_tokens - 1)


@dataclass
class EngineGauges:
    """The engine as /metrics shows it, taken where the engine runs (its thread, or its
    core process, which sends it with every step)."""

    running: int
    waiting: int
    kv_usage: float
    prefix_queried: int | None = None  # the prefix cache's running counts (None: no cache)
    prefix_hits: int | None = None
    speculation: SpeculativeMetrics | None = None  # the speculator's running totals
    generation_tokens: int = 0  # tokens sampled since the engine started

    @classmethod
    def of(cls, engine: LLMEngine) -> EngineGauges:
        prefix, spec = engine.blocks.prefix, engine.speculator
        return cls(
            len(engine.scheduler.running),
            len(engine.scheduler.waiting),
            engine.blocks.usage,
            prefix.queried_tokens if prefix is not None else None,
            prefix.hit_tokens if prefix is not None else None,
            spec.metrics if spec is not None else None,
            engine.totals["generation_tokens"],
        )

    @property
    def idle(self) -> bool:
        """Nothing running or waiting, and no KV block held."""
        return self.running == 0 and self.waiting == 0 and self.kv_usage == 0


def request_metrics(head: Sequence, t_submit: float, t_first: float | None, now: float):
    """A finished request's timings (RequestMetrics), from its first sequence."""
    return RequestMetrics(
        head.request_id,
        [str(s.finish_reason) for s in head.group],
        len(head.prompt_ids),
        sum(len(s.output_ids) for s in head.group),
        head.scheduled_time - t_submit if head.scheduled_time is not None else None,
        t_first - t_submit if t_first is not None else None,
        now - t_submit,
    )


def backlog_verdict(stream: _Stream, now: float, max_backlog, max_stall_s) -> str | None:
    """Why a stream's reader is too far behind to keep (see ReaderTooSlowError), or None."""
    backlog = stream.pushed - stream.taken
    too_many = max_backlog is not None and backlog > max_backlog
    stalled = max_stall_s is not None and backlog > 0 and now - stream.t_taken > max_stall_s
    if too_many:
        return f"{backlog} output tokens were waiting for it (at most {max_backlog})"
    if stalled:
        return (
            f"it took none of its output for {now - stream.t_taken:.0f} s (at most {max_stall_s:g})"
        )
    return None


def too_slow(stream: _Stream, why: str) -> ReaderTooSlowError:
    log.warning("request %s: the client fell behind (%s); cancelled", stream.request_id, why)
    return ReaderTooSlowError(
        f"the client read its stream too slowly: {why}; the request was cancelled"
    )


def by_request(sampled: list[Sequence]) -> dict[str, list[Sequence]]:
    """A step's sampled sequences, grouped by request (n > 1 gives several)."""
    out: dict[str, list[Sequence]] = {}
    for seq in sampled:
        out.setdefault(seq.request_id, []).append(seq)
    return out


def request_update(head: Sequence, seqs: list[Sequence], emitted: dict[int, int]) -> RequestUpdate:
    """What a step gave one request (head: its first sequence; seqs: those of its
    completions the step sampled), past the tokens `emitted` says each completion already
    handed out (updated here)."""
    deltas = []
    for s in seqs:
        k = emitted.get(s.index, 0)
        emitted[s.index] = len(s.output_ids)
        deltas.append(
            CompletionDelta(
                s.index,
                s.take_stream_text(),
                s.output_ids[k:],
                s.logprobs[k:] if s.logprobs is not None else None,
                s.finish_reason,
                s.stop_reason,
            )
        )
    return RequestUpdate(
        head.request_id,
        deltas,
        head.group_finished,
        len(head.prompt_ids),
        head.num_cached_prompt_tokens,
    )


@dataclass
class _Stream:
    request_id: str
    loop: asyncio.AbstractEventLoop
    queue: asyncio.Queue
    kwargs: dict
    head: Sequence | None = None
    emitted: dict[int, int] = field(default_factory=dict)  # tokens handed out per index
    t_submit: float = field(default_factory=time.monotonic)
    t_first: float | None = None
    t_last: float | None = None
    # the backlog: tokens pushed (written by the engine thread only) against tokens the
    # reader took (written by the reader only), and when the reader last took any
    pushed: int = 0
    taken: int = 0
    t_taken: float = field(default_factory=time.monotonic)
    text: Any = None  # over a core process: its RequestText (engine/detokenizer.py)

    def push(self, item: RequestUpdate | BaseException | None) -> bool:
        """Hand an item to the reader's event loop; False if that loop is gone."""
        try:
            self.loop.call_soon_threadsafe(self.queue.put_nowait, item)
        except RuntimeError:  # the loop was closed: nobody will read this stream again
            return False
        return True


class EngineFront(abc.ABC):
    """What every asyncio front of an engine shares (AsyncEngine here, CoreClient over a
    core process, ReplicaRouter over several): request ids, waiting for a request's
    acceptance, generate(). Each front submits and aborts its own way."""

    _next_id = 0

    def new_request_id(self, prefix: str = "req") -> str:
        self._next_id += 1
        return f"{prefix}-{self._next_id}-{time.monotonic_ns() % 10**9}"

    @abc.abstractmethod
    async def submit(self, params: SamplingParams, prompt_token_ids: list[int], **kw):
        """Queue a request; its RequestStream once accepted (see AsyncEngine.submit)."""

    @abc.abstractmethod
    def abort(self, request_id: str) -> None:
        """Cancel a request; returns at once."""

    async def _accepted(self, stream: _Stream, deadline: float | None) -> RequestStream:
        """The request's stream once the engine took it; what it raised if it refused."""
        try:
            accepted = await _next(stream.queue, deadline)
        except BaseException:
            self.abort(stream.request_id)
            raise
        if isinstance(accepted, BaseException):
            raise accepted
        return RequestStream(self, stream, deadline)

    async def generate(self, params: SamplingParams, prompt_token_ids: list[int], **kw):
        """submit() and stream in one: `async for update in engine.generate(...)`."""
        stream = await self.submit(params, prompt_token_ids, **kw)
        try:
            async for update in stream:
                yield update
        finally:
            await stream.aclose()


class AsyncEngine(EngineFront):
    def __init__(
        self,
        engine: LLMEngine,
        observer: Any = None,
        idle_wait_s: float = 0.5,
        max_backlog: int | None = None,
        max_stall_s: float | None = None,
    ):
        """max_backlog (tokens) and max_stall_s (seconds): how far a stream's reader may
        fall behind before its request is cancelled (None: no bound)."""
        self.engine = engine
        self.max_backlog, self.max_stall_s = max_backlog, max_stall_s
        self.observer = observer
        self._idle_wait_s = idle_wait_s
        self._commands: deque[tuple] = deque()
        self._wake = threading.Event()
        self._streams: dict[str, _Stream] = {}  # touched only by the engine thread
        self._thread: threading.Thread | None = None
        self._stopping = False
        self.errors = 0  # forward passes that raised

    # ------------------------------------------------------------------ lifecycle

    def start(self) -> None:
        if self._thread is None:
            self._stopping = False
            self._thread = threading.Thread(target=self._run, name="engine", daemon=True)
            self._thread.start()

    def shutdown(self) -> None:
        self._stopping = True
        self._wake.set()
        if self._thread is not None:
            self._thread.join(timeout=30)
            self._thread = None

    @property
    def is_running(self) -> bool:
        return self._thread is not None and self._thread.is_alive()

    # ------------------------------------------------------------------ the async side

    def _post(self, *command) -> None:
        self._commands.append(command)
        self._wake.set()

    async def submit(
        self,
        params: SamplingParams,
        prompt_token_ids: list[int],
        request_id: str | None = None,
        priority: int = 0,
        cache_salt: str | None = None,
        deadline: float | None = None,
    ) -> RequestStream:
        """Queue a request; once the engine has accepted it, return its stream of updates.

        Raises what LLMEngine.add_request raises (ValueError subclasses for bad input,
        QueueFullError when the queue is full). The stream raises DeadlineExceededError
        when `deadline` (a time.monotonic() value) passes first, and RequestFailedError when
        the engine fails while running the request. Leaving the stream early (break,
        cancellation, aclose) cancels the request.
        """
        if not self.is_running:
            raise EngineNotRunningError("the engine is not running (AsyncEngine.start() first)")
        request_id = request_id or self.new_request_id()
        kwargs = dict(
            params=params,
            prompt_token_ids=prompt_token_ids,
            request_id=request_id,
            priority=priority,
            cache_salt=cache_salt,
        )
        stream = _Stream(request_id, asyncio.get_running_loop(), asyncio.Queue(), kwargs)
        self._post("add", stream)
        return await self._accepted(stream, deadline)

    def abort(self, request_id: str) -> None:
        """Cancel a request (thread-safe, returns at once; applied before the next step)."""
        self._post("abort", request_id)

    # ------------------------------------------------------------------ the engine thread

    def _run(self) -> None:
        while True:
            self._wake.clear()
            self._apply_commands()
            if self._stopping:
                break
            if not self.engine.has_unfinished():
                self._wake.wait(self._idle_wait_s)
                continue
            try:
                sampled = self.engine.step()
            except Exception as e:  # the engine aborted the requests this step touched
                self.errors += 1
                log.exception("a forward pass failed; failing the requests it touched")
                self._fail_orphans(e)
                continue
            self._fail_alone(self.engine.take_failures())
            try:
                self._emit(sampled)
                if self.observer is not None and self.engine.stats:
                    gauges = EngineGauges.of(self.engine)
                    self.observer.on_step(self.engine.stats[-1].preemptions, gauges)
            except Exception:  # a bug in reporting must not stop the engine thread
                log.exception("reporting a step failed")
        for stream in self._streams.values():
            stream.push(RequestFailedError("the server is shutting down"))
        self._streams.clear()

    def _apply_commands(self) -> None:
        if self._commands and self.observer is not None:
            self._apply_commands_now()
            self.observer.on_state(EngineGauges.of(self.engine))  # an abort freed blocks
        else:
            self._apply_commands_now()

    def _apply_commands_now(self) -> None:
        while self._commands:
            kind, *args = self._commands.popleft()
            if kind == "add":
                self._add(args[0])
            elif kind == "abort":
                stream = self._streams.pop(args[0], None)
                if stream is not None:
                    self.engine.abort_request(args[0])
                    stream.push(RequestCancelledError("the request was cancelled"))

    def _add(self, stream: _Stream) -> None:
        try:
            stream.head = self.engine.add_request(**stream.kwargs)
        except Exception as e:  # bad input or a full queue: the caller's error to report
            stream.push(e)
            return
        stream.t_submit = stream.head.arrival_time
        self._streams[stream.request_id] = stream
        stream.push(None)

    def _emit(self, sampled: list[Sequence]) -> None:
        now = time.monotonic()
        for request_id, seqs in by_request(sampled).items():
            stream = self._streams.get(request_id)
            if stream is None:
                continue
            if stream.t_first is None:
                stream.t_first = now
            elif self.observer is not None:
                self.observer.on_inter_token(now - stream.t_last)
            stream.t_last = now
            update = request_update(stream.head, seqs, stream.emitted)
            deltas = update.deltas
            if update.finished:  # count it before the reader can see the end
                del self._streams[request_id]
                self._finished(stream, now)
            stream.pushed += sum(len(d.token_ids) for d in deltas)
            if not stream.push(update) and not update.finished:
                self._streams.pop(request_id, None)  # its reader's loop is gone
                self.engine.abort_request(request_id)
            elif not update.finished:
                self._check_backlog(stream, now)

    def _check_backlog(self, stream: _Stream, now: float) -> None:
        """Cancel the request of a reader too far behind (see ReaderTooSlowError)."""
        why = backlog_verdict(stream, now, self.max_backlog, self.max_stall_s)
        if why is None:
            return
        self._streams.pop(stream.request_id, None)
        self.engine.abort_request(stream.request_id)
        stream.push(too_slow(stream, why))

    def _finished(self, stream: _Stream, now: float) -> None:
        if self.observer is not None:
            metrics = request_metrics(stream.head, stream.t_submit, stream.t_first, now)
            self.observer.on_request_finished(metrics)

    def _fail_alone(self, failures: dict[str, str]) -> None:
        """Requests whose sampling raised this step (the step's others went on)."""
        for request_id, why in failures.items():
            self.errors += 1
            stream = self._streams.pop(request_id, None)
            if stream is not None:
                stream.push(RequestFailedError(f"the engine failed for this request: {why}"))

    def _fail_orphans(self, error: Exception) -> None:
        orphans = [r for r in self._streams if r not in self.engine.requests]
        if not orphans:  # it failed before touching a request (a scheduling bug?): rather
            orphans = list(self._streams)  # than fail the same way every step, fail all
            for request_id in orphans:
                self.engine.abort_request(request_id)
        for request_id in orphans:
            stream = self._streams.pop(request_id)
            stream.push(
                RequestFailedError(f"the engine failed while running this request: {error}")
            )


class RequestStream:
    """The updates of one accepted request, as an async iterator. Leaving early (break,
    cancellation, an error, aclose(), even before the first update) cancels the request."""

    def __init__(self, front: EngineFront, stream: _Stream, deadline: float | None):
        self._front, self._stream, self._deadline = front, stream, deadline
        self.request_id = stream.request_id
        self.done = False

    def __aiter__(self) -> RequestStream:
        return self

    async def __anext__(self) -> RequestUpdate:
        if self.done:
            raise StopAsyncIteration
        try:
            item = await _next(self._stream.queue, self._deadline)
        except BaseException:  # deadline, cancellation: stop the request in the engine
            await self.aclose()
            raise
        if isinstance(item, BaseException):
            self.done = True  # the engine already dropped it
            raise item
        self._stream.taken += sum(len(d.token_ids) for d in item.deltas)
        self._stream.t_taken = time.monotonic()
        self.done = item.finished
        return item

    @property
    def detokenize_s(self) -> float | None:
        """Seconds spent turning its tokens into text in this process (over a core
        process; None where the engine detokenises)."""
        text = self._stream.text
        return text.seconds if text is not None else None

    async def aclose(self) -> None:
        if not self.done:
            self.done = True
            self._front.abort(self.request_id)

    def __del__(self) -> None:  # dropped unfinished without aclose(): still cancel it
        if not self.done:
            self._front.abort(self.request_id)


async def _next(queue: asyncio.Queue, deadline: float | None):
    if deadline is None:
        return await queue.get()
    try:
        return await asyncio.wait_for(queue.get(), max(deadline - time.monotonic(), 0))
    except TimeoutError:
        raise DeadlineExceededError(
            "the request did not finish before its deadline and was cancelled"
        ) from None

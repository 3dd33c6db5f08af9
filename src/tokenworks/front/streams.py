"""A request's stream of updates, as its reader on an event loop sees it.

The thread that delivers a core's outputs (front/core_client.py) pushes each update onto
the stream's event loop; the reader takes them with `async for`. Leaving early cancels the
request. A reader that falls too far behind gets its request cancelled (backlog_verdict),
so one slow client never grows the server's memory without end.
"""

from __future__ import annotations

import asyncio
import logging
import time
from dataclasses import dataclass, field

from tokenworks.engine.detokenizer import RequestText
from tokenworks.engine.messages import DeadlineExceededError, ReaderTooSlowError, RequestUpdate

log = logging.getLogger("tokenworks.engine")


@dataclass
class Stream:
    """One request in flight, as its client holds it."""

    request_id: str
    loop: asyncio.AbstractEventLoop
    queue: asyncio.Queue
    # its completions as text (a core sends token ids alone; None where the text comes made)
    text: RequestText | None
    # the backlog: tokens pushed (written by the delivering thread only) against tokens
    # the reader took (written by the reader only), and when the reader last took any
    pushed: int = 0
    taken: int = 0
    t_taken: float = field(default_factory=time.monotonic)

    def push(self, item: RequestUpdate | BaseException | None) -> bool:
        """Hand an item to the reader's event loop; False if that loop is gone."""
        try:
            self.loop.call_soon_threadsafe(self.queue.put_nowait, item)
        except RuntimeError:  # the loop was closed: nobody will read this stream again
            return False
        return True


def backlog_verdict(stream: Stream, now: float, max_backlog, max_stall_s) -> str | None:
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


def too_slow(stream: Stream, why: str) -> ReaderTooSlowError:
    log.warning("request %s: the client fell behind (%s); cancelled", stream.request_id, why)
    return ReaderTooSlowError(
        f"the client read its stream too slowly: {why}; the request was cancelled"
    )


class RequestStream:
    """The updates of one accepted request, as an async iterator. Leaving early (break,
    cancellation, an error, aclose(), even before the first update) cancels the request
    through `abort`."""

    def __init__(self, abort, stream: Stream, deadline: float | None):
        self._abort, self._stream, self._deadline = abort, stream, deadline
        self.request_id = stream.request_id
        self.done = False

    def __aiter__(self) -> RequestStream:
        return self

    async def __anext__(self) -> RequestUpdate:
        if self.done:
            raise StopAsyncIteration
        try:
            item = await next_item(self._stream.queue, self._deadline)
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
        """Seconds spent turning its tokens into text in this process (None: its text was
        made elsewhere)."""
        text = self._stream.text
        return None if text is None else text.seconds

    async def aclose(self) -> None:
        if not self.done:
            self.done = True
            self._abort(self.request_id)

    def __del__(self) -> None:  # dropped unfinished without aclose(): still cancel it
        if not self.done:
            self._abort(self.request_id)


async def once_accepted(stream: Stream, abort, deadline: float | None) -> RequestStream:
    """The stream of a request just sent, once its engine accepted it (the first item: None,
    or the error it was refused with, raised here); leaving before that cancels it."""
    try:
        accepted = await next_item(stream.queue, deadline)
    except BaseException:
        abort(stream.request_id)
        raise
    if isinstance(accepted, BaseException):
        raise accepted
    return RequestStream(abort, stream, deadline)


async def next_item(queue: asyncio.Queue, deadline: float | None):
    """The queue's next item, or DeadlineExceededError once `deadline` (monotonic) passed."""
    if deadline is None:
        return await queue.get()
    try:
        return await asyncio.wait_for(queue.get(), max(deadline - time.monotonic(), 0))
    except TimeoutError:
        raise DeadlineExceededError(
            "the request did not finish before its deadline and was cancelled"
        ) from None

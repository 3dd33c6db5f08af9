"""Where a request's time goes in the API process, outside the engine.

Per generation request (/v1/completions, /v1/chat/completions, /v1/messages), the seconds
spent in each phase of the server's own work:

- `parse`: from the request's arrival to its handler (reading and validating the body);
- `template`: rendering the chat template (with the tools described);
- `tokenize`: the prompt's tokens;
- `detokenize`: the text of its output tokens and the stop-string checks, where the API
  process does them (an engine core in its own process; in-process the engine does);
- `respond`: encoding the response (each server-sent event, or the whole JSON body).

The middleware gives each request a RequestTimes (a context variable, so the handler and
its streaming body see the same one) and hands it to the metrics when the response is
sent: /metrics then has `tokenworks:api_process_seconds{phase}`, and `tokenworks bench
serve` records each point's mean per request.
"""

from __future__ import annotations

import contextlib
import time
from contextvars import ContextVar
from dataclasses import dataclass, field

PHASES = ("parse", "template", "tokenize", "detokenize", "respond")
TIMED_PATHS = ("/v1/completions", "/v1/chat/completions", "/v1/messages")


@dataclass
class RequestTimes:
    arrived: float = field(default_factory=time.perf_counter)
    seconds: dict[str, float] = field(default_factory=dict)
    streams: list = field(default_factory=list)  # RequestStreams whose text this request owns
    entered: bool = False

    def add(self, phase: str, seconds: float) -> None:
        self.seconds[phase] = self.seconds.get(phase, 0.0) + seconds

    def totals(self) -> dict[str, float]:
        """Each phase's seconds, detokenising included where the API process did it."""
        out = dict(self.seconds)
        detok = [s.detokenize_s for s in self.streams if s.detokenize_s is not None]
        if detok:
            out["detokenize"] = sum(detok)
        return out


_current: ContextVar[RequestTimes | None] = ContextVar("tokenworks_request_times", default=None)


def handler_entered() -> None:
    """The handler starts: what passed since arrival was parsing."""
    times = _current.get()
    if times is not None and not times.entered:
        times.entered = True
        times.add("parse", time.perf_counter() - times.arrived)


@contextlib.contextmanager
def timing(phase: str):
    times = _current.get()
    if times is None:
        yield
        return
    t0 = time.perf_counter()
    try:
        yield
    finally:
        times.add(phase, time.perf_counter() - t0)


def owns(stream) -> None:
    """The request's output comes from this engine stream (its detokenising counts)."""
    times = _current.get()
    if times is not None:
        times.streams.append(stream)


class APITimesMiddleware:
    """ASGI middleware: a RequestTimes for each generation request, reported when its
    response has been sent."""

    def __init__(self, app, report):
        self.app, self.report = app, report

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http" or scope["path"] not in TIMED_PATHS:
            return await self.app(scope, receive, send)
        times = RequestTimes()
        token = _current.set(times)
        try:
            await self.app(scope, receive, send)
        finally:
            _current.reset(token)
            if times.entered:  # (a body that never reached its handler is not a request)
                self.report(times.totals())

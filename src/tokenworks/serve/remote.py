"""A remote OpenAI-compatible engine behind this server (vLLM, llama-server, another
tokenworks): `--backend NAME=remote:MODEL@URL`, URL the upstream's API base
(http://host:port/v1; a key as http://KEY@host:port/v1 is sent as its bearer token).

OpenAI requests naming NAME are relayed as they came (the model renamed), streamed chunk
by chunk; Anthropic Messages and the Responses API become an upstream chat completion,
its streamed chunks assembled here into their events, so a client of either protocol can
reach an OpenAI-only engine. This server's keys, body limits, deadlines (the upstream's
answer must end by the request's) and metrics apply as to any backend; the upstream
checks lengths and sampling ranges itself. Its failures come back as clear errors: a
refused connection or a 5xx is a 502, no answer in time a 504, and its 4xx pass through.
"""

from __future__ import annotations

import json
import time
from urllib.parse import urlsplit, urlunsplit

import httpx
from fastapi.responses import StreamingResponse

from tokenworks.engine.messages import EngineNotRunningError, RequestMetrics
from tokenworks.serve.answer_parser import AnswerStep
from tokenworks.serve.common import respond, sse, stream_error
from tokenworks.serve.errors import APIError
from tokenworks.serve.tools import ToolCall

CONNECT_S = 10.0  # seconds to reach the upstream at all


class RemoteBackend:
    """The upstream of one served model, with the EngineFront lifecycle the server's
    shutdown and health read."""

    engine = None  # no tokenizer or admission here: the upstream has them
    max_model_len = None

    def __init__(self, name: str, spec: str):
        model, _, url = spec.partition("@")
        parts = urlsplit(url)
        if not model or parts.scheme not in ("http", "https") or not parts.hostname:
            raise ValueError(
                f"--backend {name}=remote:{spec}: give remote:MODEL@URL, URL the upstream's "
                "API base, as remote:smollm2-135m@http://127.0.0.1:8001/v1"
            )
        self.key = parts.username
        host = parts.hostname + (f":{parts.port}" if parts.port else "")
        self.base = urlunsplit((parts.scheme, host, parts.path.rstrip("/"), "", ""))
        self.root = self.base.removesuffix("/v1")  # where /tokenize lives
        self.name, self.model = name, model
        self.observer = None
        self._running, self._failing = False, None
        self._inflight = 0
        self._ids = 0

    # ------------------------------------------------------------------ lifecycle

    def start(self) -> None:
        self._running, self._failing = True, None

    def shutdown(self) -> None:
        self.fail_all("the server is shutting down")
        self._running = False

    def configure(self, observer=None, max_backlog=None, max_stall_s=None) -> None:
        self.observer = observer

    @property
    def is_running(self) -> bool:
        return self._running

    def in_flight(self) -> int:
        return self._inflight

    def fail_all(self, why: str) -> None:
        """Streams in flight end with EngineNotRunningError(why) at their next chunk."""
        self._failing = why

    def abort(self, request_id: str) -> None:
        """(A relayed stream ends when its reader leaves: the connection closes.)"""

    def new_request_id(self, prefix: str = "req") -> str:
        self._ids += 1
        return f"{prefix}-remote-{self._ids}"

    # ------------------------------------------------------------------ the upstream

    def _headers(self) -> dict:
        return {"Authorization": f"Bearer {self.key}"} if self.key else {}

    def _timeout(self, deadline: float | None) -> httpx.Timeout:
        left = None if deadline is None else max(deadline - time.monotonic(), 0.001)
        return httpx.Timeout(left, connect=min(CONNECT_S, left or CONNECT_S))

    def _failure(self, e: Exception) -> APIError:
        where = f"the remote backend {self.name} ({self.base})"
        if isinstance(e, httpx.TimeoutException):
            return APIError(504, f"{where} did not answer before the request's deadline",
                            code="upstream_timeout")  # fmt: skip
        return APIError(502, f"{where} could not be reached: {type(e).__name__}: {e}",
                        code="upstream_unavailable")  # fmt: skip

    def _refusal(self, status: int, text: str) -> APIError:
        """An upstream's error answer: its 4xx as they are, a 5xx as a 502."""
        try:
            error = json.loads(text).get("error", {})
            message = error.get("message", text) if isinstance(error, dict) else str(error)
            param = error.get("param") if isinstance(error, dict) else None
        except (json.JSONDecodeError, AttributeError):
            message, param = text[:500], None
        if status >= 500:
            return APIError(502, f"the remote backend {self.name} failed ({status}): {message}",
                            code="upstream_error")  # fmt: skip
        return APIError(status, message, param=param)

    async def post(self, path: str, body: dict, deadline: float | None, root=False) -> dict:
        """A non-streamed call: the upstream's JSON answer."""
        url = (self.root if root else self.base) + path
        try:
            async with httpx.AsyncClient(timeout=self._timeout(deadline)) as client:
                r = await client.post(url, json=body, headers=self._headers())
        except httpx.HTTPError as e:
            raise self._failure(e) from e
        if r.status_code >= 400:
            raise self._refusal(r.status_code, r.text)
        return r.json()

    async def events(self, path: str, body: dict, deadline: float | None):
        """A streamed call: each server-sent event's data, parsed, until [DONE]. The first
        is read before this returns, so a refusal is an HTTP error, not a broken stream."""
        client = httpx.AsyncClient(timeout=self._timeout(deadline))
        try:
            request = client.build_request("POST", self.base + path, json=body,
                                           headers=self._headers())  # fmt: skip
            r = await client.send(request, stream=True)
        except httpx.HTTPError as e:
            await client.aclose()
            raise self._failure(e) from e
        if r.status_code >= 400:
            text = (await r.aread()).decode(errors="replace")
            await client.aclose()
            raise self._refusal(r.status_code, text)
        return self._data(client, r)

    async def _data(self, client, r):
        self._inflight += 1
        try:
            async for line in r.aiter_lines():
                if self._failing is not None:
                    raise EngineNotRunningError(self._failing)
                if not line.startswith("data:"):
                    continue
                data = line[5:].strip()
                if data == "[DONE]":
                    return
                yield json.loads(data)
        except httpx.HTTPError as e:  # (a timeout is a 504, the rest a 502)
            raise self._failure(e) from e
        finally:
            self._inflight -= 1
            await r.aclose()
            await client.aclose()

    # ------------------------------------------------------------------ relaying

    async def relay(self, raw: dict, path: str, name: str, deadline: float | None):
        """An OpenAI request as the client sent it (the model renamed), its answer back
        under this server's name for the model: streamed chunk by chunk, or whole."""
        body = {**raw, "model": self.model}
        t0 = time.monotonic()
        if not raw.get("stream"):
            out = await self.post(path, body, deadline)
            self._finished(out, t0, None)
            return respond({**out, "model": name})
        chunks = await self.events(path, body, deadline)

        async def stream():
            first, last = None, {}
            try:
                async for chunk in chunks:
                    first = first or time.monotonic()
                    last = chunk if chunk.get("usage") else last
                    yield sse({**chunk, "model": name})
            except Exception as e:
                yield sse(stream_error(e).openai_body())
            yield sse("[DONE]")
            self._finished(last, t0, first)

        return StreamingResponse(stream(), media_type="text/event-stream")

    def _finished(self, answer: dict, t0: float, first: float | None) -> None:
        if self.observer is None:
            return
        usage = answer.get("usage") or {}
        reasons = [str(c.get("finish_reason")) for c in answer.get("choices", [])] or ["stop"]
        self.observer.on_request_finished(RequestMetrics(
            request_id=self.new_request_id(), finish_reasons=reasons,
            prompt_tokens=usage.get("prompt_tokens", 0),
            generation_tokens=usage.get("completion_tokens", 0), queue_time=None,
            ttft=None if first is None else first - t0, e2e=time.monotonic() - t0,
        ))  # fmt: skip

    async def chat_chunks(self, body: dict, deadline: float | None):
        """An upstream chat completion, streamed: its chunks, the usage chunk last."""
        body = {**body, "model": self.model, "stream": True,
                "stream_options": {"include_usage": True}}  # fmt: skip
        t0, first, usage = time.monotonic(), None, {}
        async for chunk in await self.events("/chat/completions", body, deadline):
            first = first or time.monotonic()
            usage = chunk if chunk.get("usage") else usage
            yield chunk
        self._finished(usage, t0, first)


async def chunk_steps(chunks):
    """An upstream's chat chunks as AnswerSteps (serve/answer_parser.py): its reasoning,
    text and tool calls as the answer parser's events; the finish held until the usage
    that follows."""
    call: ToolCall | None = None
    finish, usage = None, {}
    async for chunk in chunks:
        usage = chunk.get("usage") or usage
        events = []
        for choice in chunk.get("choices") or []:
            delta = choice.get("delta") or {}
            thought = delta.get("reasoning_content") or delta.get("reasoning")
            if thought:
                events.append(("reasoning", thought))
            if delta.get("content"):
                events.append(("text", delta["content"]))
            for piece in delta.get("tool_calls") or []:
                fn = piece.get("function") or {}
                if piece.get("id"):
                    if call is not None:
                        events.append(("call_end", call))
                    call = ToolCall(piece["id"], fn.get("name", ""), "")
                    events.append(("call_start", call))
                if fn.get("arguments"):
                    call.arguments += fn["arguments"]
                    events.append(("call_args", fn["arguments"]))
            if choice.get("finish_reason"):
                finish = "stop" if choice["finish_reason"] == "tool_calls" else (
                    choice["finish_reason"])  # fmt: skip
        if call is not None and finish is not None:
            events.append(("call_end", call))
            call = None
        if events:
            yield AnswerStep(0, 0, events, 0)
    cached = (usage.get("prompt_tokens_details") or {}).get("cached_tokens") or 0
    yield AnswerStep(usage.get("prompt_tokens", 0), cached, [],
                     usage.get("completion_tokens", 0), finish or "stop",
                     known_usage=True)  # fmt: skip


def tool_fields(offered: list, mode: str, name: str | None) -> dict:
    """The tools a request offers and its tool choice (mode and name, as
    tools.openai_choice / anthropic_choice give them) as an upstream chat body's fields."""
    if not offered or mode == "none":
        return {}
    named = {"type": "function", "function": {"name": name}}
    return {"tools": [t.as_openai() for t in offered],
            "tool_choice": named if mode == "named" else mode}  # fmt: skip


def response_format(constraint) -> dict:
    """A request's grammar (engine/request.py's StructuredOutput) as an upstream chat
    body's fields: response_format for JSON, vLLM's structured_outputs for the rest."""
    if constraint is None:
        return {}
    if constraint.kind == "json_object":
        return {"response_format": {"type": "json_object"}}
    if constraint.kind == "json_schema":
        schema = json.loads(constraint.value)
        spec = {"name": "output", "schema": schema}
        return {"response_format": {"type": "json_schema", "json_schema": spec}}
    value = json.loads(constraint.value) if constraint.kind == "choice" else constraint.value
    return {"structured_outputs": {constraint.kind: value}}

"""The FastAPI app: routes of both protocols, /health, /metrics, /tokenize, /detokenize,
plus what guards them: optional API keys (every path but /health, and /metrics unless
guarded too), a body size limit, and error handlers that turn every refusal into the
protocol's error object (400 naming the field, never a 500 for bad input; a 500 that
still happens leaves the connection open).

`tokenworks serve` builds it with `build_app` and runs it with uvicorn; the engine thread
starts and stops with the app (lifespan).
"""

from __future__ import annotations

import contextlib
import hmac
import logging

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response
from pydantic import BaseModel
from starlette.exceptions import HTTPException as StarletteHTTPException

from tokenworks.serve import anthropic, openai
from tokenworks.serve.common import ServerState, render_chat
from tokenworks.serve.errors import APIError, is_anthropic_path
from tokenworks.serve.protocol import DetokenizeRequest, TokenizeRequest

log = logging.getLogger("tokenworks.serve")


class BodyLimit:
    """Refuse bodies over `limit` bytes with 413: by Content-Length, or while reading a body
    sent without one (chunked). The body is read whole here, before any route sees it, so
    the refusal is a 413 however it was sent and a route never reads half a body."""

    def __init__(self, app, limit: int):
        self.app, self.limit = app, limit

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        anthropic_path = is_anthropic_path(scope.get("path", ""))
        too_big = APIError(
            413, f"the request body is over the limit of {self.limit} bytes; send less"
        )
        length = dict(scope.get("headers") or {}).get(b"content-length")
        if length is not None and length.isdigit() and int(length) > self.limit:
            return await too_big.response(anthropic_path)(scope, receive, send)
        chunks, seen, last = [], 0, None
        while True:
            message = await receive()
            if message["type"] != "http.request":  # the client left mid-body
                last = message
                break
            chunks.append(message.get("body", b""))
            seen += len(chunks[-1])
            if seen > self.limit:
                return await too_big.response(anthropic_path)(scope, receive, send)
            if not message.get("more_body"):
                break
        body = b"".join(chunks)
        replayed = False

        async def replay():
            nonlocal replayed
            if not replayed:
                replayed = True
                return last or {"type": "http.request", "body": body, "more_body": False}
            return await receive()  # after the body: the disconnect, when it comes

        await self.app(scope, replay, send)


class CatchAll:
    """The last guard: an exception no handler turned into an error response becomes a
    500 in the protocol's shape, and the connection stays open for the client's next
    request (left to Starlette, the exception would close it). Streams that have started
    end their own way (an error event, then the end of the stream)."""

    def __init__(self, app):
        self.app = app

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        started = False

        async def watch(message):
            nonlocal started
            if message["type"] == "http.response.start":
                started = True
            await send(message)

        try:
            await self.app(scope, receive, watch)
        except Exception as e:
            log.exception("unhandled error on %s", scope.get("path"))
            if started:
                return
            err = APIError(500, f"internal error ({type(e).__name__}); the server carries on")
            await err.response(is_anthropic_path(scope.get("path", "")))(scope, receive, send)


class KeyGuard:
    """With API keys configured, every path but /health (and /metrics, unless it is
    guarded too) needs one: Authorization: Bearer KEY or x-api-key: KEY. The key that
    matched is left in the request's state (scope["state"]["api_key"]) for tenant salts."""

    def __init__(self, app, keys: tuple[str, ...], open_paths: tuple[str, ...]):
        self.app, self.keys, self.open_paths = app, [k.encode() for k in keys], open_paths

    def _matching(self, headers: dict) -> str | None:
        given = headers.get(b"x-api-key", b"")
        auth = headers.get(b"authorization", b"")
        if not given and auth[:7].lower() == b"bearer ":
            given = auth[7:].strip()
        found = None
        for key in self.keys:  # compare with every key, so timing says nothing of which
            if hmac.compare_digest(given, key):
                found = key
        return found.decode() if found is not None else None

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http" or scope.get("path") in self.open_paths:
            return await self.app(scope, receive, send)
        key = self._matching(dict(scope.get("headers") or []))
        if key is None:
            err = APIError(
                401, "missing or wrong API key (Authorization: Bearer KEY or x-api-key: KEY)"
            )
            return await err.response(is_anthropic_path(scope.get("path", "")))(
                scope, receive, send
            )
        scope.setdefault("state", {})["api_key"] = key
        await self.app(scope, receive, send)


def _field(loc) -> str:
    parts = [str(p) for p in loc if p not in ("body",)]
    return ".".join(parts) or "body"


class ErrorBody(BaseModel):
    """An error, as OpenAI writes it (the /v1/messages routes write Anthropic's shape:
    {"type": "error", "error": {"type", "message"}})."""

    error: dict


_ERRORS = {
    400: "the request is invalid: the message names the field (error.param)",
    401: "missing or wrong API key",
    404: "no such model or route",
    413: "the body is over --max-body-mb",
    429: "the waiting queue is full (OpenAI routes); retry after Retry-After seconds",
    500: "the engine failed for this request alone; the server carries on",
    504: "the request did not finish before its deadline or --request-timeout",
    529: "the waiting queue is full (Anthropic routes); retry after Retry-After seconds",
}
ERROR_RESPONSES = {code: {"model": ErrorBody, "description": d} for code, d in _ERRORS.items()}


def build_app(state: ServerState) -> FastAPI:
    """The app over a ServerState: its limits, API keys and tenant salts come from there."""

    @contextlib.asynccontextmanager
    async def lifespan(app: FastAPI):
        state.engine.start()
        try:
            yield
        finally:
            state.engine.shutdown()

    app = FastAPI(
        title="tokenworks",
        lifespan=lifespan,
        docs_url=None,
        redoc_url=None,
        responses=ERROR_RESPONSES,
    )
    app.state.tokenworks = state

    @app.exception_handler(APIError)
    async def api_error(request: Request, e: APIError):
        return e.response(is_anthropic_path(request.url.path))

    @app.exception_handler(RequestValidationError)
    async def invalid(request: Request, e: RequestValidationError):
        errors = e.errors()
        first = errors[0] if errors else {"loc": (), "msg": "invalid request", "type": ""}
        if first.get("type") == "json_invalid":
            err = APIError(400, f"the body is not valid JSON: {first.get('msg')}", "body")
        else:
            field = _field(first.get("loc", ()))
            more = f" (and {len(errors) - 1} more problems)" if len(errors) > 1 else ""
            err = APIError(400, f"{field}: {first.get('msg')}{more}", param=field)
        return err.response(is_anthropic_path(request.url.path))

    @app.exception_handler(StarletteHTTPException)
    async def http_error(request: Request, e: StarletteHTTPException):
        message = {404: f"no route {request.url.path}", 405: "method not allowed"}.get(
            e.status_code, str(e.detail)
        )
        return APIError(e.status_code, message).response(is_anthropic_path(request.url.path))

    # each added one wraps the ones before: errors are caught around everything, and the
    # key is checked before any body is read
    app.add_middleware(BodyLimit, limit=state.limits.max_body_bytes)
    if state.api_keys:
        open_paths = ("/health",) if state.metrics_require_key else ("/health", "/metrics")
        app.add_middleware(KeyGuard, keys=state.api_keys, open_paths=open_paths)
    app.add_middleware(CatchAll)
    app.include_router(openai.router)
    app.include_router(anthropic.router)

    @app.get("/health")
    async def health():
        if not state.engine.is_running:
            return JSONResponse({"status": "engine stopped"}, status_code=503)
        return {"status": "ok"}

    @app.get("/metrics")
    async def metrics():
        return Response(state.metrics.render(), media_type="text/plain; version=0.0.4")

    @app.post("/tokenize")
    async def tokenize(body: TokenizeRequest):
        if body.model is not None:
            state.check_model(body.model)
        if (body.prompt is None) == (body.messages is None):
            raise APIError(400, "give either prompt or messages", param="prompt")
        if body.messages is not None:
            text = render_chat(
                state,
                openai.chat_messages(body.messages),
                [],
                add_generation_prompt=body.add_generation_prompt,
            )
        else:
            text = body.prompt
        ids = state.tokenizer.encode(text, add_special_tokens=body.add_special_tokens)
        return {"tokens": ids, "count": len(ids), "max_model_len": state.max_model_len}

    @app.post("/detokenize")
    async def detokenize(body: DetokenizeRequest):
        if body.model is not None:
            state.check_model(body.model)
        vocab = state.engine.engine.spec.vocab_size
        bad = [t for t in body.tokens if not 0 <= t < vocab]
        if bad:
            raise APIError(400, f"token ids {bad[:5]} are outside [0, {vocab})", param="tokens")
        return {"prompt": state.tokenizer.decode(body.tokens, skip_special_tokens=False)}

    return app

"""The FastAPI app: routes of both protocols, /health, /metrics, /tokenize, /detokenize,
plus what guards them: an optional API key, a body size limit, and error handlers that
turn every refusal into the protocol's error object (400 naming the field, never a 500
for bad input).

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
from starlette.exceptions import HTTPException as StarletteHTTPException

from tokenworks.serve import anthropic, openai
from tokenworks.serve.common import ServerState, render_chat
from tokenworks.serve.errors import APIError, is_anthropic_path
from tokenworks.serve.protocol import DetokenizeRequest, TokenizeRequest

log = logging.getLogger("tokenworks.serve")

MiB = 1024 * 1024


class BodyLimit:
    """Refuse bodies over `limit` bytes with 413, by Content-Length or while reading."""

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
        seen = 0

        async def limited():
            nonlocal seen
            message = await receive()
            if message["type"] == "http.request":
                seen += len(message.get("body", b""))
                if seen > self.limit:
                    raise too_big
            return message

        try:
            await self.app(scope, limited, send)
        except APIError as e:
            if e is not too_big:
                raise
            await too_big.response(anthropic_path)(scope, receive, send)


def _field(loc) -> str:
    parts = [str(p) for p in loc if p not in ("body",)]
    return ".".join(parts) or "body"


def build_app(
    state: ServerState, api_key: str | None = None, max_body_bytes: int = 8 * MiB
) -> FastAPI:
    @contextlib.asynccontextmanager
    async def lifespan(app: FastAPI):
        state.engine.start()
        try:
            yield
        finally:
            state.engine.shutdown()

    app = FastAPI(title="tokenworks", lifespan=lifespan, docs_url=None, redoc_url=None)
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

    @app.exception_handler(Exception)
    async def unexpected(request: Request, e: Exception):
        log.exception("unhandled error on %s", request.url.path)
        err = APIError(500, f"internal error ({type(e).__name__}); the server carries on")
        return err.response(is_anthropic_path(request.url.path))

    if api_key:

        @app.middleware("http")
        async def check_key(request: Request, call_next):
            if request.url.path.startswith("/v1/"):
                given = request.headers.get("x-api-key") or ""
                auth = request.headers.get("authorization") or ""
                if auth.lower().startswith("bearer "):
                    given = given or auth[7:]
                if not hmac.compare_digest(given.encode(), api_key.encode()):
                    err = APIError(
                        401,
                        "missing or wrong API key (Authorization: Bearer KEY or x-api-key: KEY)",
                    )
                    return err.response(is_anthropic_path(request.url.path))
            return await call_next(request)

    app.add_middleware(BodyLimit, limit=max_body_bytes)
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
                state, body.messages, [], add_generation_prompt=body.add_generation_prompt
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

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

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response
from pydantic import BaseModel
from starlette.exceptions import HTTPException as StarletteHTTPException

from tokenworks.serve import anthropic, embeddings, lora_routes, openai, responses, web
from tokenworks.serve.api_times import APITimesMiddleware
from tokenworks.serve.common import ServerState, render_chat
from tokenworks.serve.errors import APIError, is_anthropic_path
from tokenworks.serve.guards import BodyLimit, CatchAll, Drain, KeyGuard
from tokenworks.serve.protocol import DetokenizeRequest, NotTextError, TokenizeRequest


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
    503: "the server is shutting down, or its engine is not running",
    504: "the request did not finish before its deadline or --request-timeout",
    529: "the waiting queue is full (Anthropic routes); retry after Retry-After seconds",
}
ERROR_RESPONSES = {code: {"model": ErrorBody, "description": d} for code, d in _ERRORS.items()}


def build_app(state: ServerState) -> FastAPI:
    """The app over a ServerState: its limits, API keys and tenant salts come from there."""

    @contextlib.asynccontextmanager
    async def lifespan(app: FastAPI):
        for front in state.fronts:
            front.start()
        try:
            yield
        finally:
            for front in state.fronts:
                front.shutdown()

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
        not_text = (first.get("ctx") or {}).get("error")
        if isinstance(not_text, NotTextError):
            err = APIError(400, str(not_text), param=not_text.field)
        elif first.get("type") == "json_invalid":
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
        open_paths = ("/health", *web.OPEN_PATHS)  # the page's own files; its data need the key
        if not state.metrics_require_key:
            open_paths += ("/metrics",)
        app.add_middleware(KeyGuard, keys=state.api_keys, open_paths=open_paths)
    app.add_middleware(CatchAll)
    app.add_middleware(Drain, state=state)
    app.add_middleware(APITimesMiddleware, report=state.metrics.on_api_times)
    app.include_router(openai.router)
    app.include_router(anthropic.router)
    app.include_router(embeddings.router)
    app.include_router(responses.router)
    app.include_router(lora_routes.router)
    app.include_router(web.router)

    @app.get("/health")
    async def health():
        if state.draining:
            return JSONResponse({"status": "shutting down"}, status_code=503)
        if not all(front.is_running for front in state.fronts):
            return JSONResponse({"status": "engine stopped"}, status_code=503)
        return {"status": "ok"}

    @app.get("/metrics")
    async def metrics():
        return Response(state.metrics.render(), media_type="text/plain; version=0.0.4")

    @app.post("/tokenize")
    async def tokenize(body: TokenizeRequest, request: Request):
        model = state.for_model(body.model) if body.model is not None else state
        if model.remote is not None:
            return await _upstream(model, request, "/tokenize")
        if (body.prompt is None) == (body.messages is None):
            raise APIError(400, "give either prompt or messages", param="prompt")
        if body.messages is not None:
            text = render_chat(
                model,
                openai.chat_messages(body.messages),
                [],
                add_generation_prompt=body.add_generation_prompt,
            )
        else:
            text = body.prompt
        ids = model.tokenizer.encode(text, add_special_tokens=body.add_special_tokens)
        return {"tokens": ids, "count": len(ids), "max_model_len": model.max_model_len}

    @app.get("/tokenizer_info")
    async def tokenizer_info():
        """vLLM's endpoint: what a client needs to tokenise as the server does
        (lm-evaluation-harness's remote tokenizer reads it)."""
        tok = state.tokenizer

        def text(token_id: int | None) -> str | None:
            return tok.token_to_str(token_id) if token_id is not None else None

        eos = tok.eos_token_ids[0] if tok.eos_token_ids else None
        return {
            "tokenizer_class": "TokenizerWrapper",
            "eos_token": text(eos),
            "bos_token": text(tok.bos_token_id),
            "pad_token": None,
            "add_bos_token": tok.add_bos,
            "chat_template": state.chat.source if state.chat is not None else None,
            "model_max_length": state.max_model_len,
            "vocab_size": state.engine.engine.admission.vocab_size,
        }

    @app.post("/detokenize")
    async def detokenize(body: DetokenizeRequest, request: Request):
        model = state.for_model(body.model) if body.model is not None else state
        if model.remote is not None:
            return await _upstream(model, request, "/detokenize")
        vocab = model.engine.engine.admission.vocab_size
        bad = [t for t in body.tokens if not 0 <= t < vocab]
        if bad:
            raise APIError(400, f"token ids {bad[:5]} are outside [0, {vocab})", param="tokens")
        return {"prompt": model.tokenizer.decode(body.tokens, skip_special_tokens=False)}

    return app


async def _upstream(model: ServerState, request: Request, path: str) -> dict:
    """A remote model's /tokenize or /detokenize: the upstream's own answer."""
    raw = {**(await request.json()), "model": model.remote.model}
    return await model.remote.post(path, raw, model.deadline(None), root=True)

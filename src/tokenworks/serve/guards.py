"""The ASGI guards around the app, each with one job: refuse oversize bodies (413), demand
an API key (401), turn an exception no handler caught into a 500 that leaves the
connection open, and count the requests in flight, refusing new ones (503) once the server
is shutting down. They answer in the protocol's error shape (serve/errors.py)."""

from __future__ import annotations

import hmac
import logging

from tokenworks.serve.errors import APIError, is_anthropic_path

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


class Drain:
    """Count the requests in flight (a stream until its last event) in `state.active`, and
    once `state.draining` (the server got SIGTERM or SIGINT), answer new ones 503: a load
    balancer sends them elsewhere while those in flight finish. /health and /metrics pass:
    /health says 503 itself."""

    OPEN = ("/health", "/metrics")

    def __init__(self, app, state):
        self.app, self.state = app, state

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http" or scope.get("path") in self.OPEN:
            return await self.app(scope, receive, send)
        if self.state.draining:
            err = APIError(503, "the server is shutting down; send the request elsewhere")
            return await err.response(is_anthropic_path(scope.get("path", "")))(
                scope, receive, send
            )
        self.state.active += 1
        try:
            await self.app(scope, receive, send)
        finally:
            self.state.active -= 1


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

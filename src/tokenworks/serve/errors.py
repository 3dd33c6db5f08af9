"""Errors as the two protocols spell them, with the HTTP status each one gets.

OpenAI: {"error": {"message", "type", "param", "code"}}.
Anthropic: {"type": "error", "error": {"type", "message"}} (529 overloaded_error when busy).
Every refusal says what to change; nothing a client sends may turn into a 500.
"""

from __future__ import annotations

# status -> (OpenAI type, Anthropic type)
_TYPES = {
    400: ("invalid_request_error", "invalid_request_error"),
    401: ("authentication_error", "authentication_error"),
    404: ("not_found_error", "not_found_error"),
    408: ("timeout_error", "timeout_error"),  # a stream's reader fell too far behind
    413: ("invalid_request_error", "request_too_large"),
    429: ("rate_limit_error", "rate_limit_error"),
    500: ("server_error", "api_error"),
    503: ("server_error", "overloaded_error"),
    504: ("timeout_error", "timeout_error"),
    529: ("rate_limit_error", "overloaded_error"),
}


class APIError(Exception):
    def __init__(
        self,
        status: int,
        message: str,
        param: str | None = None,
        code: str | None = None,
        retry_after: int | None = None,
    ):
        super().__init__(message)
        self.status, self.message, self.param, self.code = status, message, param, code
        self.retry_after = retry_after

    def openai_body(self) -> dict:
        kind = _TYPES.get(self.status, _TYPES[500])[0]
        return {
            "error": {"message": self.message, "type": kind, "param": self.param, "code": self.code}
        }

    def anthropic_body(self) -> dict:
        kind = _TYPES.get(self.status, _TYPES[500])[1]
        return {"type": "error", "error": {"type": kind, "message": self.message}}

    def response(self, anthropic: bool = False):
        from fastapi.responses import JSONResponse  # here: the CLI reads limits without fastapi

        headers = {"Retry-After": str(self.retry_after)} if self.retry_after else None
        body = self.anthropic_body() if anthropic else self.openai_body()
        return JSONResponse(body, status_code=self.status, headers=headers)


def bad_request(message: str, param: str | None = None) -> APIError:
    return APIError(400, message, param=param)


def is_anthropic_path(path: str) -> bool:
    return path.startswith("/v1/messages")

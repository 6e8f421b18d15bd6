"""Error bodies: the one place where an error becomes a wire body, in its protocol's shape.

- OpenAI (Chat Completions, Completions, Responses):
  {"error": {"message": ..., "type": ..., "param": ..., "code": ...}}
- Anthropic (Messages): {"type": "error", "error": {"type": ..., "message": ...}}, its type
  named by the status in Anthropic's vocabulary (overloaded_error, not_found_error, ...).

Error types and params are OpenAI's (TallowError and Rejection carry them); Anthropic's shape
has no param or code.
"""

from __future__ import annotations

from starlette.responses import JSONResponse

OPENAI = "openai"
ANTHROPIC = "anthropic"

# Anthropic's status for "overloaded": what a full admission queue answers there.
ANTHROPIC_OVERLOADED = 529

# OpenAI's error type for a status, where the caller names none.
_OPENAI_TYPES = {400: "invalid_request_error", 401: "authentication_error", 413: "invalid_request_error",
                 429: "rate_limit_error", 503: "service_unavailable"}
_ANTHROPIC_TYPES = {400: "invalid_request_error", 401: "authentication_error", 403: "permission_error",
                    404: "not_found_error", 405: "invalid_request_error", 413: "request_too_large",
                    429: "rate_limit_error",
                    503: "overloaded_error", ANTHROPIC_OVERLOADED: "overloaded_error"}


def protocol_for_path(path: str) -> str:
    """The protocol whose error shape a route answers in: Anthropic's under /v1/messages."""
    return ANTHROPIC if path.startswith("/v1/messages") else OPENAI


def error_body(protocol: str, status: int, message: str, type: str | None = None, param: str | None = None,
               code: str | None = None) -> dict:
    """The error body of `protocol` (OPENAI or ANTHROPIC). `type` is OpenAI's error type (by default
    the status's: server_error for a 5xx); Anthropic's is named by the status."""
    if protocol == ANTHROPIC:
        return {"type": "error", "error": {"type": _ANTHROPIC_TYPES.get(status, "api_error"), "message": message}}
    if type is None:
        type = _OPENAI_TYPES.get(status, "server_error")
    return {"error": {"message": message, "type": type, "param": param, "code": code}}


def error_response(protocol: str, status: int, message: str, type: str | None = None, param: str | None = None,
                   code: str | None = None, headers: dict | None = None) -> JSONResponse:
    """error_body as a JSON response with `status`."""
    return JSONResponse(error_body(protocol, status, message, type, param, code), status, headers=headers)

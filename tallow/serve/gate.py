"""RequestGate: the ASGI middleware every request passes first.

For every request: a request id (the client's `x-request-id` when it is sane, else a new
one) sent back in the `x-request-id` header, a RequestRecord set as the current request, one
access-log line at the end, and a trace line when traced. For /v1 routes, before any route
code runs: the API key (401), shutdown (503 while draining), the body cap (413, from
Content-Length when given, else while reading) and media/file content parts (400). Errors
come in the route's protocol shape: Anthropic's on /v1/messages, OpenAI's elsewhere.
Being in front of the router, these hold for every /v1 route, present and future.
"""

from __future__ import annotations

import logging
import re
import time
import uuid
from dataclasses import dataclass

from starlette.datastructures import Headers
from starlette.responses import JSONResponse

from tallow.config import ServerConfig
from tallow.serve.access_log import RequestRecord, access_log, current_request
from tallow.serve.errors import error_response, protocol_for_path
from tallow.serve.metrics import ServerMetrics
from tallow.serve.security import api_key_matches, remote_content_part
from tallow.serve.trace import RequestTrace

trace_log = logging.getLogger("tallow.trace")

_CLIENT_REQUEST_ID = re.compile(r"[A-Za-z0-9._:-]{1,128}")
# Routes polled by machines: their access lines go to DEBUG.
_QUIET_ROUTES = frozenset({"/health", "/metrics"})
# What answers without the API key: a load balancer's probe, and the chat page's static files
# (public: it holds nothing secret and asks for the key itself; not with --no-ui). Everything
# else (/v1, /stats, /metrics, /docs, /openapi.json, /tokenize, ...) needs it when the server has one.
_OPEN_ROUTES = frozenset({"/health"})


def _open_route(path: str, config: ServerConfig) -> bool:
    return path in _OPEN_ROUTES or (config.ui and (path == "/" or path.startswith("/ui/")))


@dataclass
class GateState:
    """What the shutdown sequence reads and sets: /v1 requests in flight, and whether to refuse new ones."""

    in_flight: int = 0
    draining: bool = False


class RequestGate:
    def __init__(self, app, *, config: ServerConfig, metrics: ServerMetrics, state: GateState):
        self.app = app
        self.config = config
        self.metrics = metrics
        self.state = state

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        headers = Headers(scope=scope)
        start = time.monotonic()
        given_id = headers.get("x-request-id", "")
        request_id = given_id if _CLIENT_REQUEST_ID.fullmatch(given_id) else uuid.uuid4().hex
        record = RequestRecord(request_id, scope["method"], scope["path"], start)
        if self.config.trace or headers.get("x-tallow-trace") == "1":
            record.trace = RequestTrace(start)
        id_header = (b"x-request-id", request_id.encode())

        async def send_with_id(message) -> None:
            if message["type"] == "http.response.start":
                record.status = message["status"]
                message = {**message, "headers": [*message.get("headers", []), id_header]}
            await send(message)

        is_api = scope["path"] == "/v1" or scope["path"].startswith("/v1/")
        context = current_request.set(record)
        if is_api:
            self.state.in_flight += 1
        try:
            await self._serve(scope, receive, send_with_id, headers, is_api)
        except BaseException:
            record.status = record.status or 500
            raise
        finally:
            if is_api:
                self.state.in_flight -= 1
            current_request.reset(context)
            self._log(record, is_api)

    async def _serve(self, scope, receive, send, headers: Headers, is_api: bool) -> None:
        path, config = scope["path"], self.config

        def refuse(status: int, message: str, param: str | None = None, headers: dict | None = None):
            return error_response(protocol_for_path(path), status, message, param=param, headers=headers)(
                scope, receive, send)

        if self.state.draining and path == "/health":
            return await JSONResponse({"status": "draining"}, 503)(scope, receive, send)
        if config.api_key is not None and not _open_route(path, config) and not api_key_matches(headers, config.api_key) \
                and not (path == "/metrics" and config.metrics_key is not None
                         and api_key_matches(headers, config.metrics_key)):
            return await refuse(401, "invalid or missing API key: send it as 'Authorization: Bearer <key>' "
                                     "or 'x-api-key: <key>'")
        if not is_api:
            return await self.app(scope, receive, send)
        if self.state.draining:
            return await refuse(503, "the server is shutting down", headers={"Retry-After": "1"})
        if scope["method"] == "POST":
            too_large = f"the request body exceeds {config.max_body_bytes} bytes"
            declared = headers.get("content-length", "")
            if declared.isdigit() and int(declared) > config.max_body_bytes:
                return await refuse(413, too_large)
            body = await _read_body(receive, config.max_body_bytes)
            if body is None:
                return await refuse(413, too_large)
            part = remote_content_part(body)
            if part is not None:
                return await refuse(400, f"{part}: media and file content parts are not supported (this server "
                                         f"has no vision or file inputs, and never fetches URLs)", part)
            receive = _replay(body, receive)
        await self.app(scope, receive, send)

    def _log(self, record: RequestRecord, is_api: bool) -> None:
        end = time.monotonic()
        if is_api and record.status is not None:
            self.metrics.reject(record.status)
        level = logging.DEBUG if record.route in _QUIET_ROUTES else logging.INFO
        access_log.log(level, record.line(end))
        if record.trace is not None:
            trace_log.info(record.trace.to_json(record.request_id, record.route, record.status,
                                                record.finish_reasons, end))


async def _read_body(receive, limit: int) -> bytes | None:
    """The whole body, or None as soon as it passes `limit` bytes."""
    chunks, size = [], 0
    while True:
        message = await receive()
        if message["type"] != "http.request":  # the client left: the route sees an empty body
            break
        chunk = message.get("body", b"")
        size += len(chunk)
        if size > limit:
            return None
        chunks.append(chunk)
        if not message.get("more_body", False):
            break
    return b"".join(chunks)


def _replay(body: bytes, receive):
    """A receive() that gives `body` once, then passes on to the real one (disconnects)."""
    given = False

    async def replay():
        nonlocal given
        if not given:
            given = True
            return {"type": "http.request", "body": body, "more_body": False}
        return await receive()

    return replay

"""RequestGate: the ASGI middleware every request passes first.

For every request: a request id (the client's `x-request-id` when it is sane, else a new
one) sent back in the `x-request-id` header, a RequestRecord set as the current request, one
access-log line at the end, and a trace line when traced. For /v1 routes, before any route
code runs: the API key (401), shutdown (503 while draining), the body bound and media/file
content parts (400). Errors come in the route's protocol shape: Anthropic's on /v1/messages,
OpenAI's elsewhere. Being in front of the router, these hold for every /v1 route, present and
future.

The body bound, checked from Content-Length when given, else while the body arrives (and so
before anything parses it): --max-body-bytes (413), or, once a model is attached and where it is
smaller, the longest body a request that fits the model's context can have (400 naming it:
security.ContextBound; /v1/completions takes up to --max-prompts prompts). Other POST routes
(/tokenize, /detokenize) are held to --max-body-bytes. A client that leaves (or is timed out)
while sending its body is not served at all. After a request with a big body, the heap is
trimmed (memory.HeapTrimmer).
"""

from __future__ import annotations

import asyncio
import logging
import re
import time
import uuid
from dataclasses import dataclass, field

from starlette.datastructures import Headers
from starlette.responses import JSONResponse

from tallow.config import ServerConfig
from tallow.serve.access_log import RequestRecord, access_log, current_request
from tallow.serve.errors import error_response, protocol_for_path
from tallow.serve.memory import HeapTrimmer
from tallow.serve.metrics import ServerMetrics
from tallow.serve.security import ContextBound, api_key_matches, remote_content_part
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


# Bodies past this are searched for media parts in a worker thread, not on the event loop.
_PARSE_OFF_LOOP_BYTES = 64 * 1024
# What a body read ends with when the client went away before sending all of it.
_GONE = object()


@dataclass
class GateState:
    """What the shutdown sequence reads and sets: /v1 requests in flight, and whether to refuse new ones."""

    in_flight: int = 0
    draining: bool = False
    # Set when a model is attached (app.attach_engine): the body bound its context implies.
    context_bound: ContextBound | None = None
    trimmer: HeapTrimmer = field(default_factory=HeapTrimmer)


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
        body_bytes = 0
        try:
            body_bytes = await self._serve(scope, receive, send_with_id, headers, is_api)
        except BaseException:
            record.status = record.status or 500
            raise
        finally:
            if is_api:
                self.state.in_flight -= 1
            current_request.reset(context)
            self._log(record, is_api)
            self.state.trimmer.after_request(body_bytes)

    async def _serve(self, scope, receive, send, headers: Headers, is_api: bool) -> int:
        """Serve the request; returns the length of its body, as far as it was read."""
        path, config = scope["path"], self.config

        def refuse(status: int, message: str, param: str | None = None, headers: dict | None = None):
            return error_response(protocol_for_path(path), status, message, param=param, headers=headers)(
                scope, receive, send)

        if self.state.draining and path == "/health":
            await JSONResponse({"status": "draining"}, 503)(scope, receive, send)
            return 0
        if config.api_key is not None and not _open_route(path, config) and not api_key_matches(headers, config.api_key) \
                and not (path == "/metrics" and config.metrics_key is not None
                         and api_key_matches(headers, config.metrics_key)):
            await refuse(401, "invalid or missing API key: send it as 'Authorization: Bearer <key>' "
                              "or 'x-api-key: <key>'")
            return 0
        if is_api and self.state.draining:
            await refuse(503, "the server is shutting down", headers={"Retry-After": "1"})
            return 0
        if scope["method"] != "POST":
            await self.app(scope, receive, send)
            return 0
        limit, status, too_large = self._body_limit(path, is_api)
        declared = headers.get("content-length", "")
        if declared.isdigit() and int(declared) > limit:
            await refuse(status, too_large)
            return 0
        body = await _read_body(receive, limit)
        if body is None:
            await refuse(status, too_large)
            return limit
        if body is _GONE:  # nobody to answer: the request is not served
            current_request.get().status = 499
            return 0
        if is_api:
            part = (remote_content_part(body) if len(body) < _PARSE_OFF_LOOP_BYTES
                    else await asyncio.to_thread(remote_content_part, body))
            if part is not None:
                await refuse(400, f"{part}: media and file content parts are not supported (this server "
                                  f"has no vision or file inputs, and never fetches URLs)", part)
                return len(body)
        await self.app(scope, _replay(body, receive), send)
        return len(body)

    def _body_limit(self, path: str, is_api: bool) -> tuple[int, int, str]:
        return body_limit(self.config, self.state.context_bound, path, is_api)

    def _log(self, record: RequestRecord, is_api: bool) -> None:
        end = time.monotonic()
        if is_api and record.status is not None:
            self.metrics.reject(record.status)
        level = logging.DEBUG if record.route in _QUIET_ROUTES else logging.INFO
        access_log.log(level, record.line(end))
        if record.trace is not None:
            trace_log.info(record.trace.to_json(record.request_id, record.route, record.status,
                                                record.finish_reasons, end))


def body_limit(config: ServerConfig, bound: ContextBound | None, path: str,
               is_api: bool = True) -> tuple[int, int, str]:
    """(the longest body a POST to `path` may have, the status past it, the message)."""
    cap = config.max_body_bytes
    if is_api and bound is not None:
        prompts = config.max_prompts if path == "/v1/completions" else 1
        limit = bound.body_bytes(prompts)
        if limit < cap:
            return limit, 400, bound.message(limit, prompts)
    return cap, 413, f"the request body exceeds {cap} bytes"


async def _read_body(receive, limit: int):
    """The whole body; None as soon as it passes `limit` bytes; _GONE when the client left first."""
    chunks, size = [], 0
    while True:
        message = await receive()
        if message["type"] != "http.request":
            return _GONE
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

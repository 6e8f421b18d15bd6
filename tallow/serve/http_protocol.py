"""The HTTP connection layer: uvicorn's httptools protocol with read timeouts and a connection cap.

uvicorn has no limit on how long a request may take to arrive, and an ASGI middleware sees a
request only once its headers are complete, so a client sending one header byte a second
(slowloris) held its connection, and its file descriptor, for ever. `TimedHttpProtocol` (passed
to uvicorn as Config(http=...)) adds, per connection:

- a read timeout: a request's headers and body must arrive within `read_timeout` seconds of its
  first byte (of the connection's opening, for its first request). The timer is armed on
  connection_made and at each request's first byte, and cancelled when its body is complete, so
  the time the server takes to answer, a streamed response included, is never limited. When it
  fires: a request whose answer has not started gets a 408 and the connection is closed; one
  whose answer has started (a refusal sent before its body was read) is closed; a pipelined
  request arriving behind one still being answered closes the connection after that answer.
- a connection cap, `max_connections`, below the open-file limit (`connection_cap`): a
  connection opened while as many are open gets a 503 to its request, with Retry-After and
  Connection: close, in the route's protocol's error shape, and has OVER_CAP_TIMEOUT_S for that
  request to arrive, so a flood of idle sockets gives its file descriptors back quickly.
  Connections opened before the flood keep being served.

Idle keep-alive connections are closed by uvicorn after its timeout_keep_alive (run_server
passes --keep-alive-timeout).
"""

from __future__ import annotations

import json
import logging
import resource
import time

from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol

from tallow.errors import TallowError
from tallow.serve.errors import error_body, error_response, protocol_for_path

log = logging.getLogger(__name__)

# File descriptors kept back from client connections: the model's files, logs, the engine's pipes
# and sockets, tensor-parallel workers.
FD_RESERVE = 128
# The default cap's ceiling, whatever the open-file limit.
DEFAULT_MAX_CONNECTIONS = 4096
# A connection past the cap: how long its request has to arrive before it is closed.
OVER_CAP_TIMEOUT_S = 1.0
# At most one warning per this many seconds about refused connections.
_WARN_EVERY_S = 10.0


def connection_cap(configured: int | None) -> int:
    """The connection cap: `configured` (--max-connections), or the open-file limit less
    FD_RESERVE, at most DEFAULT_MAX_CONNECTIONS. A configured cap the limit cannot hold is an
    error (past the limit accept() fails, and every new client with it)."""
    soft, _ = resource.getrlimit(resource.RLIMIT_NOFILE)
    room = DEFAULT_MAX_CONNECTIONS * 16 if soft == resource.RLIM_INFINITY else soft - FD_RESERVE
    if configured is None:
        return max(1, min(room, DEFAULT_MAX_CONNECTIONS))
    if configured < 1:
        raise TallowError(f"--max-connections must be at least 1, got {configured}")
    if configured > room:
        raise TallowError(f"--max-connections {configured} is more than the open-file limit ({soft}, ulimit -n) "
                          f"leaves for connections ({room}, keeping {FD_RESERVE} for the server's own files): "
                          f"raise the limit or lower --max-connections")
    return configured


def timed_protocol(read_timeout: float, max_connections: int) -> type["TimedHttpProtocol"]:
    """The protocol class for uvicorn's Config(http=...), with these limits."""
    return type("TimedHttpProtocol", (TimedHttpProtocol,),
                {"read_timeout": read_timeout, "max_connections": max_connections})


class TimedHttpProtocol(HttpToolsProtocol):
    read_timeout: float = 30.0
    max_connections: int = DEFAULT_MAX_CONNECTIONS
    # Across the server's connections: what was refused or timed out (and when a warning was last logged).
    refused = 0
    timed_out = 0
    _warned_at = 0.0

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self._read_timer = None
        self._headers_done = False
        self._over_cap = False

    # ---- the timer --------------------------------------------------------------------------------
    def _arm(self, timeout: float) -> None:
        self._disarm()
        self._read_timer = self.loop.call_later(timeout, self._read_timed_out)

    def _disarm(self) -> None:
        if self._read_timer is not None:
            self._read_timer.cancel()
            self._read_timer = None

    def connection_made(self, transport) -> None:
        super().connection_made(transport)
        self._over_cap = len(self.connections) > self.max_connections
        self._arm(min(self.read_timeout, OVER_CAP_TIMEOUT_S) if self._over_cap else self.read_timeout)

    def connection_lost(self, exc) -> None:
        self._disarm()
        super().connection_lost(exc)

    def on_message_begin(self) -> None:
        super().on_message_begin()
        self._headers_done = False
        if self._read_timer is None:
            self._arm(self.read_timeout)

    def on_headers_complete(self) -> None:
        self._headers_done = True
        if not self._over_cap:
            super().on_headers_complete()
            return
        type(self).refused += 1
        self._warn(f"{len(self.connections)} connections are open, over the cap of {self.max_connections} "
                   f"(--max-connections): answering 503")
        app, self.app = self.app, _over_capacity
        try:
            super().on_headers_complete()
        finally:
            self.app = app

    def on_message_complete(self) -> None:
        self._disarm()
        super().on_message_complete()

    def _read_timed_out(self) -> None:
        self._read_timer = None
        if self.transport.is_closing():
            return
        cycle = self.cycle
        if self._headers_done:  # the body is late
            if cycle is not None and cycle.response_started:
                self.transport.close()  # answered already (a refusal before the body was read)
                return
        elif cycle is not None and not cycle.response_complete:
            # The headers of a pipelined request are late behind a request still being answered:
            # that answer finishes, then the connection closes.
            cycle.keep_alive = False
            return
        type(self).timed_out += 1
        self._send_408()

    def _send_408(self) -> None:
        path = self.scope.get("path", "") if self._headers_done and self.scope else ""
        body = json.dumps(error_body(protocol_for_path(path), 408, f"the request did not arrive within "
                                     f"{self.read_timeout:g} s (--http-read-timeout)", "timeout")).encode()
        self.transport.write(b"HTTP/1.1 408 Request Timeout\r\ncontent-type: application/json\r\n"
                             b"content-length: %d\r\nconnection: close\r\n\r\n%s" % (len(body), body))
        self.transport.close()

    def _warn(self, message: str) -> None:
        now = time.monotonic()
        if now - TimedHttpProtocol._warned_at >= _WARN_EVERY_S:
            TimedHttpProtocol._warned_at = now
            log.warning("%s (%d refused so far)", message, type(self).refused)


async def _over_capacity(scope, receive, send) -> None:
    """The answer on a connection past the cap."""
    await error_response(protocol_for_path(scope["path"]), 503,
                         "the server has too many open connections; retry shortly",
                         headers={"Retry-After": "1", "Connection": "close"})(scope, receive, send)

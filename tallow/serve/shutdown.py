"""Graceful shutdown: SIGTERM (or Ctrl+C) drains the server, then it exits with status 0.

Draining: /v1 routes and /health answer 503 at once (the listener stays open, so clients
get an answer rather than a refused connection), requests in flight run on for up to
`shutdown_timeout` seconds, then whatever is left is aborted (their clients get the end of
the response, finish_reason "abort") and uvicorn stops. A second signal exits at once.
uvicorn's own handling would close the listener first and re-raise the signal after
stopping, so the process would die by SIGTERM instead of exiting 0.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import signal
import time
from collections.abc import Awaitable, Callable

import uvicorn

from tallow.serve.gate import GateState

log = logging.getLogger(__name__)

# How long aborted responses get to reach their clients before uvicorn cancels them.
ABORT_GRACE_S = 5
_POLL_S = 0.05


class DrainingServer(uvicorn.Server):
    def __init__(self, config: uvicorn.Config, gate: GateState, shutdown_timeout: float,
                 abort_all: Callable[[], Awaitable[None]]):
        super().__init__(config)
        self.gate = gate
        self.shutdown_timeout = shutdown_timeout
        self.abort_all = abort_all
        self._drain: asyncio.Task | None = None

    @contextlib.contextmanager
    def capture_signals(self):
        loop = asyncio.get_running_loop()
        signals = (signal.SIGTERM, signal.SIGINT)
        for sig in signals:
            loop.add_signal_handler(sig, self._on_signal, sig)
        try:
            yield
        finally:
            for sig in signals:
                loop.remove_signal_handler(sig)

    async def shutdown(self, sockets=None) -> None:
        await super().shutdown(sockets)
        if self.force_exit:
            # uvicorn skips the lifespan's shutdown on a forced exit (a second Ctrl+C): its task
            # would then be cancelled with the loop, and Starlette logs that CancelledError as a
            # traceback. The app has no shutdown handlers, so this is immediate.
            await self.lifespan.shutdown()

    def _on_signal(self, sig: int) -> None:
        if self._drain is not None:  # the second signal: stop now
            log.warning("%s again: exiting without waiting", signal.Signals(sig).name)
            self.should_exit = self.force_exit = True
            return
        log.warning("%s: draining (%d requests in flight, up to %.0f s)", signal.Signals(sig).name,
                    self.gate.in_flight, self.shutdown_timeout)
        self._drain = asyncio.get_running_loop().create_task(self.drain())

    async def drain(self) -> None:
        """Refuse new requests, wait for those in flight up to the timeout, abort the rest, stop."""
        self.gate.draining = True
        deadline = time.monotonic() + self.shutdown_timeout
        while self.gate.in_flight and time.monotonic() < deadline:
            await asyncio.sleep(_POLL_S)
        if self.gate.in_flight:
            log.warning("shutdown timeout: aborting %d requests still in flight", self.gate.in_flight)
            await self.abort_all()
            deadline = time.monotonic() + ABORT_GRACE_S
            while self.gate.in_flight and time.monotonic() < deadline:
                await asyncio.sleep(_POLL_S)
        self.should_exit = True
